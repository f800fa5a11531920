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
  };

  void drain_loop();
  void drain_ring(uint32_t ring_index);
  bool has_undrained_chunks() const;
  // "" if `chunk` can come next on a ring whose message in progress is `partial`, else what is wrong with it.
  std::string chunk_problem(const ChunkHeader& chunk, const PartialMessage& partial) const;
  int ring_index_of(int peer) const;

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
