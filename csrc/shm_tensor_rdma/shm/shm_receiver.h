// The receive side of the shared-memory backend: owns this rank's segment and copies each arriving chunk out of
// its slot into a private buffer, freeing the slot at once. Complete messages go to the Inbox.
// While a thread of ours is blocked in recv/wait_any it does the copying itself (it has nothing else to do, and
// it saves a thread hand-off on the latency path); otherwise a background thread does, so copy-out overlaps the
// sender's copy-in and this rank's compute.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "buffer_pool.h"
#include "doorbell.h"
#include "inbox.h"
#include "outgoing_message.h"
#include "process_identity.h"
#include "shm_layout.h"
#include "shm_segment.h"

namespace mapp {

struct ReceiverConfig {
  std::string job_id;
  int rank;
  int world_size;
  std::vector<int> peers;  // ranks that send to us, one ring each
  uint64_t slot_bytes;
  uint32_t num_slots;  // shared out evenly between the rings
  uint64_t max_message_bytes;
};

class ShmReceiver {
 public:
  // Creates and publishes the segment and starts the drain thread. Throws std::runtime_error.
  ShmReceiver(const ReceiverConfig& config, Inbox* inbox, std::shared_ptr<BufferPool> pool);
  ~ShmReceiver();
  ShmReceiver(const ShmReceiver&) = delete;
  ShmReceiver& operator=(const ShmReceiver&) = delete;

  // Marks the calling thread as a foreground drainer for its lifetime: producers then wake it (not the drain
  // thread) for each chunk, and it must call drain_available() after each wake-up.
  class ForegroundWait {
   public:
    explicit ForegroundWait(ShmReceiver& receiver);
    ~ForegroundWait();
    ForegroundWait(const ForegroundWait&) = delete;
    ForegroundWait& operator=(const ForegroundWait&) = delete;

   private:
    ShmReceiver& receiver_;
  };

  // Wakes foreground waiters: rung for chunks published while one waits, for completed messages, and by close().
  Doorbell& arrivals() { return foreground_; }
  // Copies out every chunk published so far. With wait_for_lock=false, returns at once if another thread drains.
  void drain_available(bool wait_for_lock = true);
  // The process that attached to send to us from `peer`, once it has.
  std::optional<ProcessIdentity> producer(int peer) const;
  // True once `peer` closed its transport (if it had attached to us).
  bool producer_closed(int peer) const;
  // Why the ring of `peer` is no longer drained (its producer wrote something no sender writes), or nullopt.
  std::optional<std::string> corruption(int peer);

  // Receives straight from the slots, for a caller that copies each chunk out itself (a device copy engine reading
  // the registered slot): claim() marks the next message (peer, tag) that has not begun to be copied out; its
  // chunks then stay in their slots (the drain stops at its first chunk, and copies out the rest of the ring again
  // once it is taken). next_claimed() hands out its chunks in order without freeing them; release_claimed() frees
  // the oldest handed out (the sender may then overwrite it: call it only once nothing reads the slot any more)
  // and returns true after the message's last chunk, which ends the claim. cancel_claim() withdraws a claim:
  // cleanly while no chunk was handed out, else by failing the ring (the message cannot be resumed).
  // claim() first copies out what has arrived, and returns false (nothing claimed) when the ring is failed or has a
  // claim already, or a message with `tag` is being copied out.
  bool claim(int peer, uint64_t tag);
  std::optional<ReceivedChunk> next_claimed(int peer);
  bool release_claimed(int peer);
  void cancel_claim(int peer);
  // This ring's slots in our own segment: what next_claimed() points into (for registering it with a device).
  SlotRegion receive_region(int peer) const;
  // Stops draining, tells producers we are closed, removes our name. The mapping stays until destruction so that
  // threads still inside a call never touch unmapped memory.
  void close();

 private:
  struct PartialMessage {
    bool active = false;
    MessageHeader header;
    PooledBuffer payload;
    uint64_t received = 0;
  };
  // What the owner knows of a ring without trusting the segment: the producer's rank, how far it consumed, and
  // why it stopped if the producer wrote garbage.
  struct RingState {
    int producer_rank;
    uint64_t consumed = 0;
    std::string corruption;
    // claim(): the tag claimed, whether its first chunk sits at `consumed` (the drain then leaves the ring alone),
    // its header, and how far next_claimed() got (chunks handed out and not released follow `consumed`).
    bool claimed = false;
    uint64_t claim_tag = 0;
    bool held = false;
    MessageHeader claim_header{};
    uint64_t handed_out = 0;
    uint64_t handed_bytes = 0;
    uint64_t chunks_seen = 0;
  };

  void drain_loop();
  void drain_ring(uint32_t ring_index);
  bool has_undrained_chunks() const;
  // "" if `chunk` can come next on a ring whose message in progress is `partial`, else what is wrong with it.
  std::string chunk_problem(const ChunkHeader& chunk, const PartialMessage& partial) const;
  int ring_index_of(int peer) const;
  // The ring of `peer`; throws std::invalid_argument for a rank that sends us nothing.
  uint32_t ring_of_peer(int peer, const char* action) const;
  // Marks the ring failed with `what` (caller holds drain_mutex_).
  void fail_ring(uint32_t ring_index, const std::string& what);

  Inbox* inbox_;
  std::shared_ptr<BufferPool> pool_;
  std::unique_ptr<ShmSegment> segment_;
  SegmentView view_;
  Doorbell foreground_;
  Doorbell background_;
  int rank_;
  uint64_t max_message_bytes_;
  std::vector<PartialMessage> partial_;  // per ring; guarded by drain_mutex_
  std::vector<RingState> rings_;         // per ring; guarded by drain_mutex_
  std::mutex drain_mutex_;
  std::atomic<bool> stopping_{false};
  std::thread drain_thread_;
  bool closed_ = false;  // guarded by drain_mutex_
};

}  // namespace mapp
