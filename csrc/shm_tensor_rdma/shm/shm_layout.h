// Layout of a receive segment ("/mapp_<job>_r<rank>"): one per receiving rank, one ring of slots per peer that
// may send to it. Each ring has exactly one producer (the peer) and one consumer (the owner).
//
//   SegmentHeader | RingControl x rings | ChunkHeader x (rings * slots) | pad to page | slot data x (rings * slots)
//
// After publishing a chunk a producer calls notify_chunk_published(header).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "doorbell.h"
#include "message.h"
#include "process_identity.h"

namespace mapp {

constexpr uint64_t kSegmentMagic = 0x31766d68735f6d61ULL;  // "am_shmv1"
constexpr uint32_t kLayoutVersion = 1;

struct alignas(64) RingControl {
  int32_t producer_rank;
  std::atomic<int32_t> producer_pid;  // written by the producer when it attaches
  std::atomic<uint64_t> producer_start_time;
  std::atomic<uint32_t> producer_closed;  // set by the producer's close(): nothing more will come
  alignas(64) std::atomic<uint64_t> head;  // chunks published (producer)
  alignas(64) std::atomic<uint64_t> tail;  // chunks consumed (owner)
  alignas(64) DoorbellWords space;         // rung by the owner after freeing slots
};

struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t layout_version;
  int32_t owner_rank;
  int32_t world_size;
  int32_t owner_pid;
  uint64_t owner_start_time;
  uint32_t num_rings;
  uint32_t slots_per_ring;
  uint64_t slot_bytes;
  uint64_t rings_offset;
  uint64_t chunks_offset;
  uint64_t data_offset;
  uint64_t total_bytes;
  uint32_t expected_attach;           // producers that will attach; the name is removed once all have
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> closed;       // set by the owner on close
  // Who copies chunks out: a thread of the owner blocked in recv/wait_any ("foreground") if there is one, else
  // the owner's drain thread. Producers ring only the bell of the one that drains, so a blocked receiver is
  // woken once per chunk and never competes with its drain thread.
  alignas(64) std::atomic<uint32_t> foreground_waiters;
  alignas(64) DoorbellWords foreground;  // wakes threads blocked in recv/wait_any
  alignas(64) DoorbellWords background;  // wakes the drain thread
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");

// Rings the bell of whoever drains the segment now (see SegmentHeader::foreground_waiters).
void notify_chunk_published(SegmentHeader& header);

struct SegmentGeometry {
  uint32_t num_rings;
  uint32_t slots_per_ring;
  uint64_t slot_bytes;
  uint64_t rings_offset;
  uint64_t chunks_offset;
  uint64_t data_offset;
  uint64_t total_bytes;

  static SegmentGeometry compute(uint32_t num_rings, uint32_t slots_per_ring, uint64_t slot_bytes);
};

// Typed access to a mapped segment. Does not own the memory. The geometry is copied out when the view is made:
// whatever another process writes into the header later cannot move a ring, a chunk header or a slot.
class SegmentView {
 public:
  // Builds a fresh segment in zeroed memory of geometry.total_bytes.
  static SegmentView initialize(uint8_t* base, const SegmentGeometry& geometry, int owner_rank, int world_size,
                                const ProcessIdentity& owner, const std::vector<int>& producer_ranks);
  // Checks magic, version and that every offset lies inside `size`; nullopt if not a valid segment.
  static std::optional<SegmentView> validate(uint8_t* base, size_t size);

  SegmentHeader& header() const { return *reinterpret_cast<SegmentHeader*>(base_); }
  uint32_t num_rings() const { return geometry_.num_rings; }
  uint32_t slots_per_ring() const { return geometry_.slots_per_ring; }
  uint64_t slot_bytes() const { return geometry_.slot_bytes; }
  RingControl& ring(uint32_t ring_index) const;
  ChunkHeader& chunk(uint32_t ring_index, uint64_t slot) const;
  uint8_t* slot_data(uint32_t ring_index, uint64_t slot) const;
  // Index of the ring that `producer_rank` writes to, or -1.
  int ring_of(int producer_rank) const;
  ProcessIdentity owner() const;

 private:
  SegmentView(uint8_t* base, const SegmentGeometry& geometry) : base_(base), geometry_(geometry) {}
  uint8_t* base_;
  SegmentGeometry geometry_;
};

}  // namespace mapp
