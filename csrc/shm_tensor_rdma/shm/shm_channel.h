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

  // Bytes per chunk for a message of `nbytes`: a message is cut into several chunks, published one by one, so
  // that the receiver copies chunk k out while chunk k+1 is copied in (at most one slot each). Used when the
  // receiver has caught up; behind it, a message goes in whole slots (publish_chunk).
  uint64_t chunk_bytes_for(uint64_t nbytes) const;
  // Copies the chunks of `message` from `*offset` on while the ring has free slots and `*offset` < `until`,
  // publishing each at once; advances `*offset`. Never blocks. Returns true once the whole message is sent
  // (false when nothing could be sent, or only part of it).
  bool send_now(const OutgoingMessage& message, uint64_t* offset, uint64_t until);
  // Copies the message from `offset` on, chunk by chunk, sleeping while the ring is full. Throws PeerDiedError,
  // ClosedError, TimeoutError.
  void send(const OutgoingMessage& message, const SendLimits& limits, uint64_t offset = 0);

  const ProcessIdentity& owner() const { return owner_; }
  bool owner_closed() const { return view_.header().closed.load(std::memory_order_acquire) != 0; }
  // Slot leases, for a caller that fills slots itself (a device copy engine writing straight into shared memory):
  // reserve() waits for a free slot beyond those already leased, writes the chunk header of the message's chunk
  // starting at `offset` into it and returns where its `length` payload bytes go; commit() publishes the oldest
  // leased chunk. Chunks are leased and committed in message order; nothing else may send on this channel while
  // leases are outstanding. Throws like send().
  SlotLease reserve(const OutgoingMessage& message, uint64_t offset, const SendLimits& limits);
  void commit();
  // Leased and not yet committed (0 when none).
  uint64_t leased() const { return leased_; }
  // This rank's slots in the peer's segment: the memory that leases point into (for registering it with a device).
  SlotRegion slot_region() const;
  // Wakes a thread of ours sleeping in send() so it re-checks why it waits.
  void wake_sender();
  // Tells the receiver that this rank closed: it will send nothing more.
  void mark_producer_closed();

 private:
  ShmChannel(std::unique_ptr<ShmSegment> segment, SegmentView view, uint32_t ring_index, int peer_rank);
  bool ring_full() const;
  // Writes the chunk starting at `offset` into the next slot and publishes it; returns its length.
  uint64_t publish_chunk(const OutgoingMessage& message, uint64_t offset);
  // Waits until the ring has a free slot beyond the `ahead` already leased.
  void wait_for_free_slot(const OutgoingMessage& message, const SendLimits& limits, uint64_t ahead = 0);

  std::unique_ptr<ShmSegment> segment_;
  SegmentView view_;
  RingControl& ring_;
  uint32_t ring_index_;
  int peer_rank_;
  ProcessIdentity owner_;
  uint64_t chunk_bytes_ = 0;  // of the message being sent, chosen at its first chunk
  uint64_t leased_ = 0;       // slots reserved and not yet committed (they follow head)
};

}  // namespace mapp
