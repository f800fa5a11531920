// The send side of the shared-memory backend for one link: this rank's ring inside a peer's receive segment.
// One thread at a time uses a channel (the worker pool serialises work per peer).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "message.h"
#include "outgoing_message.h"
#include "process_identity.h"
#include "shm_layout.h"
#include "shm_segment.h"

namespace mapp {

class ShmChannel {
 public:
  // Attaches to `peer_rank`'s segment. Returns nullptr while it does not exist or is a stale leftover of a dead
  // process. Throws std::runtime_error if the segment does not accept messages from `my_rank`.
  static std::unique_ptr<ShmChannel> attach(const std::string& job_id, int my_rank, int world_size, int peer_rank);

  // Copies the whole message now if the ring has room for all of it; otherwise does nothing and returns false.
  bool try_send_now(const OutgoingMessage& message);
  // Copies the message chunk by chunk, sleeping while the ring is full. Throws PeerDiedError, ClosedError,
  // TimeoutError.
  void send(const OutgoingMessage& message, const SendLimits& limits);

  const ProcessIdentity& owner() const { return owner_; }
  bool owner_closed() const { return view_.header().closed.load(std::memory_order_acquire) != 0; }
  // Wakes a thread of ours sleeping in send() so it re-checks why it waits.
  void wake_sender();
  // Tells the receiver that this rank closed: it will send nothing more.
  void mark_producer_closed();

 private:
  ShmChannel(std::unique_ptr<ShmSegment> segment, SegmentView view, uint32_t ring_index, int peer_rank);
  uint64_t chunks_for(uint64_t nbytes) const;
  void write_chunk(const OutgoingMessage& message, uint64_t offset, uint64_t length, uint64_t head);
  void wait_for_free_slot(const OutgoingMessage& message, const SendLimits& limits);

  std::unique_ptr<ShmSegment> segment_;
  SegmentView view_;
  RingControl& ring_;
  uint32_t ring_index_;
  int peer_rank_;
  ProcessIdentity owner_;
};

}  // namespace mapp
