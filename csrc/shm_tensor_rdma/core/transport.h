// One rank's endpoint: owns the inbox, one backend per kind its peers use (made by the factory in
// backend_registry.h, all behind the Backend interface) and the send workers. Validates every argument; errors are
// the types in errors.h.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend.h"
#include "backend_registry.h"
#include "buffer_pool.h"
#include "doorbell.h"
#include "inbox.h"
#include "message.h"
#include "send_request.h"
#include "transport_options.h"
#include "wait_tick.h"
#include "worker_pool.h"

namespace mapp {


class Transport {
 public:
  explicit Transport(TransportOptions options);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Posts a send and returns at once; `data` must stay valid until the request is done. Returns nullptr when
  // the message was already copied into the peer's ring (small messages, ring not full).
  std::shared_ptr<SendRequest> send(int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                                    const void* data, uint64_t nbytes);
  // Slot leases for a caller that fills the peer's slots itself (Backend::reserve_slot): the caller must have no
  // send to `peer` in flight (wait for its requests first) and post none until every lease is committed.
  SlotLease reserve_slot(int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                         uint64_t nbytes, uint64_t offset);
  void commit_slot(int peer);
  SlotRegion slot_region(int peer);
  // Receives straight from this rank's slots (Backend::claim_receive, ShmReceiver::claim): claim_receive returns
  // false, nothing claimed, when `peer`'s backend cannot or (peer, tag) has arrived already (take it the ordinary
  // way); next_claimed_chunk blocks for the claimed message's next chunk (PeerDiedError, ClosedError,
  // TimeoutError like recv); release_claimed_chunk frees the oldest chunk handed out, once nothing reads its slot,
  // and returns true after the last; cancel_claim withdraws the claim (failing the link once chunks were taken).
  bool claim_receive(int peer, uint64_t tag);
  ReceivedChunk next_claimed_chunk(int peer, std::optional<double> timeout_s);
  bool release_claimed_chunk(int peer);
  void cancel_claim(int peer);
  SlotRegion receive_region(int peer);
  // Receive buffers come from [base, base + bytes) while it has room (BufferPool::set_arena; the caller keeps the
  // memory alive as long as any received buffer may use it). Once per transport.
  void set_receive_arena(uint8_t* base, size_t bytes) { pool_->set_arena(base, bytes); }
  // Waits for every send posted so far; rethrows the first failure not reported yet.
  void wait_sends(std::optional<double> timeout_s);
  // Keys of messages fully arrived and not yet taken, oldest first. Never blocks.
  std::vector<MessageKey> poll();
  std::optional<MessageHeader> peek(int peer, uint64_t tag);
  std::optional<Message> try_take(int peer, uint64_t tag);
  // Blocks until one of `keys` has arrived (without taking it). timeout nullopt means options.timeout_s.
  MessageKey wait_any(const std::vector<MessageKey>& keys, std::optional<double> timeout_s);
  Message recv(int peer, uint64_t tag, std::optional<double> timeout_s);
  // Why `peer` can no longer send to us (it died, or closed its transport), or nullopt while it can: asked by a
  // caller that failed to use something the peer lent (a CUDA IPC handle) to tell a dead peer from other errors.
  std::optional<PeerFailure> peer_failure(int peer);
  // Cancels sends not completed yet (their requests fail with ClosedError), stops all threads, removes this
  // rank's name and any name of this job left by a dead process. Idempotent.
  void close();
  bool closed() const { return closing_.load(); }
  // How long a blocked receive polls before it sleeps (default kSpinBeforeSleep). A transport that carries device
  // tensors spins longer: a message's turnaround there (CUDA calls, a device copy each way) outlasts 50 us, and a
  // sleeping thread's wake-up on a GPU host was measured at ~300 us. The spin still yields to contention.
  void set_wait_spin(std::chrono::microseconds spin) { wait_spin_us_.store(spin.count(), std::memory_order_relaxed); }
  std::chrono::microseconds wait_spin() const {
    return std::chrono::microseconds(wait_spin_us_.load(std::memory_order_relaxed));
  }
  // Run by blocking calls about every kWaitTick; what it throws ends the wait.
  void set_interrupt_check(InterruptCheck check) { interrupt_check_ = std::move(check); }
  // Runs on every complete incoming message before it is published, whatever backend carried it (the loss layer).
  void set_arrival_filter(std::shared_ptr<ArrivalFilter> filter) { inbox_.set_arrival_filter(std::move(filter)); }
  const std::vector<int>& peers() const { return peers_; }
  // The name of the backend through which this rank reaches `peer` ("shm", "tcp", "rdma").
  std::string backend_of(int peer) const;
  // Where peers reach this rank over `backend` ("host:port"); throws std::invalid_argument if it serves no peer.
  std::string local_address(const std::string& backend) const;
  // Connections dropped before admission by this rank's listeners (every remote backend together).
  uint64_t strangers_dropped() const;
  // Tells a remote backend where `peer` listens (from the address exchange through the torch.distributed store).
  void set_peer_address(int peer, const std::string& address);
  int rank() const { return options_.rank; }

  // Removes what processes of `job_id` that are gone left behind (shm segments); returns their names.
  static std::vector<std::string> cleanup_job(const std::string& job_id);

 private:
  void check_usable();
  void validate_peer(int peer, const char* action) const;
  // Raises (once) every send failure not reported yet, as one exception.
  void report_pending_failure();
  static void raise_first_failure(const std::vector<std::shared_ptr<SendRequest>>& failed);
  // Queues `message` from byte `offset` on for the peer's send worker; returns its request.
  std::shared_ptr<SendRequest> post_send(int peer, const OutgoingMessage& message, uint64_t offset);
  void perform_send(const std::shared_ptr<SendRequest>& request, int peer, const OutgoingMessage& message,
                    uint64_t offset);
  // Makes one backend per kind in use (registry order) and maps each peer to its backend.
  void create_backends();
  void make_backend(const BackendKind& kind, const std::map<std::string, std::vector<int>>& peers_of);
  void collect_arrivals(bool wait_for_lock = true) {
    for (const auto& backend : backends_) backend->collect_arrivals(wait_for_lock);
  }
  void note_failure(const std::shared_ptr<SendRequest>& request);
  void track(const std::shared_ptr<SendRequest>& request);
  MessageKey wait_for_keys(const std::vector<MessageKey>& keys, std::optional<double> timeout_s);
  // Throws PeerDiedError / ClosedError if a peer named in `keys` can no longer send (after collecting everything
  // it sent); returns a key if that final collection completed one.
  std::optional<MessageKey> check_senders(const std::vector<MessageKey>& keys);

  const TransportOptions options_;
  const int creator_pid_;  // a forked child must neither use nor tear down its parent's transport
  InterruptCheck interrupt_check_;
  const std::vector<int> peers_;
  std::vector<bool> is_peer_;
  std::shared_ptr<BufferPool> pool_;
  Inbox inbox_;
  DoorbellWords own_arrival_words_;
  Doorbell own_arrivals_{&own_arrival_words_};
  // The doorbell every backend rings when a message arrives: ours, or one a backend brings (Backend::own_arrivals).
  Doorbell* arrivals_ = &own_arrivals_;
  std::vector<std::unique_ptr<Backend>> backends_;  // registry order; closed and destroyed in reverse
  std::vector<Backend*> backend_of_;                // per rank: its backend, nullptr for ranks that are not peers
  std::vector<bool> sends_inline_;                  // per rank: its backend's sends_inline()
  std::unique_ptr<WorkerPool> workers_;
  std::atomic<bool> closing_{false};
  std::atomic<int64_t> wait_spin_us_{kSpinBeforeSleep.count()};
  std::mutex close_mutex_;

  std::mutex requests_mutex_;
  std::vector<std::shared_ptr<SendRequest>> outstanding_;
  std::vector<std::shared_ptr<SendRequest>> failures_;
};

}  // namespace mapp
