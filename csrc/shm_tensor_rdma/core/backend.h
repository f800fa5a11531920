// The one interface every transport backend implements (shm, tcp, rdma), in the manner of gloo's Device/Pair: the
// Transport owns one Backend per kind in use, maps each peer to one, and knows nothing of how a backend moves
// bytes. Backends are made by the factory in backend_registry.h.
// Sends: the transport calls send() on its worker thread for that peer (one at a time per peer, in order), or
// send_now() on the caller's thread for small messages when sends_inline() (shm, tcp).
// Receives: each backend publishes every complete message with Inbox::put (the one place every backend publishes,
// so a hook there sees all traffic) and then rings the arrivals doorbell.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "doorbell.h"
#include "inbox.h"
#include "outgoing_message.h"

namespace mapp {

// Why a peer can no longer send to us: it died (connection lost, process gone) or closed its transport cleanly.
struct PeerFailure {
  bool died;
  std::string text;  // "peer rank 3 (10.0.0.2:41234): connection reset by peer"
};

// What every backend gets from the transport.
struct BackendContext {
  int rank;
  int world_size;
  std::string job_id;
  std::string admission_secret;  // what a connection to this rank's listener must prove (admission.h)
  std::vector<int> peers;  // the peers this backend serves, both directions
  uint64_t max_message_bytes;
  Inbox* inbox;
  Doorbell* arrivals;  // the transport's doorbell (see Backend::own_arrivals)
  std::shared_ptr<BufferPool> pool;
  uint64_t slot_bytes;  // shared-memory ring geometry
  uint32_t num_slots;
  std::string listen_host;  // where remote backends listen, and the address peers are told
  int listen_port;          // 0: any free port
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;

  // A doorbell this backend's peers ring from their own processes (shm: a futex word in this rank's segment). The
  // transport then waits on it and hands it to the backends made after this one; nullptr: ring context.arrivals.
  virtual Doorbell* own_arrivals() { return nullptr; }

  // What a peer needs to reach us ("host:port"); published through the torch.distributed store. Throws
  // std::invalid_argument for a backend whose peers need no address.
  virtual std::string local_address() const = 0;
  // Connections this backend's listener dropped before admission (strangers); 0 for backends without one.
  virtual uint64_t strangers_dropped() const { return 0; }
  // Where `peer` listens. Sends to a peer wait (bounded by their timeout) until its address is known.
  virtual void set_peer_address(int peer, const std::string& address) = 0;

  // Whether send_now() can ever send anything (the transport then starts sends on the caller's thread).
  virtual bool sends_inline() const { return false; }
  // Sends the message from `*offset` on, as far as that cannot block and while `*offset` < `until`; advances
  // `*offset`. Returns true once the whole message is sent. The offset is the backend's own progress count (shm:
  // payload bytes; tcp: frame bytes, header included): the transport only hands it back to send().
  virtual bool send_now(int peer, const OutgoingMessage& message, uint64_t* offset, uint64_t until) { return false; }
  // Blocks until the message from `offset` on (what send_now() left; 0 for backends that never send inline)
  // is handed over: the caller's buffer is free again. Throws PeerDiedError, ClosedError, TimeoutError.
  virtual void send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) = 0;

  // Slot leases (shm only; others throw std::invalid_argument): the caller fills a slot of the peer's ring itself,
  // e.g. a device copy engine writing straight into shared memory, then commits it. See ShmChannel::reserve.
  // reserve_slot blocks like send() (attaching to the peer first if needed); commit_slot publishes the oldest
  // leased chunk. The transport keeps other sends to the peer out while leases are outstanding.
  virtual SlotLease reserve_slot(int peer, const OutgoingMessage& message, uint64_t offset,
                                 const SendLimits& limits) {
    throw std::invalid_argument(std::string("the ") + name() + " backend lends no slots");
  }
  virtual void commit_slot(int peer) { throw std::invalid_argument(std::string("the ") + name() + " backend lends no slots"); }
  // The memory reserve_slot() lends from for `peer` (waits for the peer's segment like reserve_slot).
  virtual SlotRegion slot_region(int peer, const SendLimits& limits, uint64_t tag) {
    throw std::invalid_argument(std::string("the ") + name() + " backend lends no slots");
  }

  // Receives straight from the slots (shm only; see ShmReceiver::claim): claim_receive returns false (nothing
  // claimed) where the backend cannot, or the message is already on its way out of the slots; the others throw
  // std::invalid_argument on backends without slots. next_claimed_chunk never blocks.
  virtual bool claim_receive(int peer, uint64_t tag) { return false; }
  virtual std::optional<ReceivedChunk> next_claimed_chunk(int peer) { throw no_receive_slots(); }
  virtual bool release_claimed_chunk(int peer) { throw no_receive_slots(); }
  virtual void cancel_claim(int peer) { throw no_receive_slots(); }
  virtual SlotRegion receive_region(int peer) { throw no_receive_slots(); }

  // Publishes arrivals that wait for a caller's thread (shm copies chunks out of its rings; remote backends
  // publish from their own threads). With wait_for_lock=false, returns at once if another thread is at it.
  virtual void collect_arrivals(bool wait_for_lock) {}
  // Held by a thread while it blocks waiting for arrivals (and calls collect_arrivals after every wake-up).
  class ForegroundWait {
   public:
    virtual ~ForegroundWait() = default;
  };
  // nullptr: this backend does not care who waits.
  virtual std::unique_ptr<ForegroundWait> foreground_wait() { return nullptr; }

  // Set once `peer` can send nothing more; everything it sent before is in the inbox when this returns.
  virtual std::optional<PeerFailure> failure(int peer) = 0;

  // Wakes our threads blocked inside send() so they re-check why they wait (the transport is closing).
  virtual void wake_senders() {}
  // Called after the send workers stopped: says goodbye to peers, stops and joins the backend's threads.
  virtual void close() = 0;

 private:
  std::invalid_argument no_receive_slots() const {
    return std::invalid_argument(std::string("the ") + name() + " backend receives into no slots");
  }
};

}  // namespace mapp
