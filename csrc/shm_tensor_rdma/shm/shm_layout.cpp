#include "shm_layout.h"

#include <new>

namespace mapp {
namespace {

constexpr uint64_t kPageBytes = 4096;

uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

void notify_chunk_published(SegmentHeader& header) {
  // seq_cst pairs with the waiter's increment: either we see the foreground waiter, or it sees our chunk.
  if (header.foreground_waiters.load(std::memory_order_seq_cst) != 0) {
    Doorbell(&header.foreground).ring();
  } else {
    Doorbell(&header.background).ring();
  }
}

SegmentGeometry SegmentGeometry::compute(uint32_t num_rings, uint32_t slots_per_ring, uint64_t slot_bytes) {
  SegmentGeometry geometry;
  geometry.num_rings = num_rings;
  geometry.slots_per_ring = slots_per_ring;
  geometry.slot_bytes = slot_bytes;
  geometry.rings_offset = round_up(sizeof(SegmentHeader), 64);
  geometry.chunks_offset = geometry.rings_offset + uint64_t{num_rings} * sizeof(RingControl);
  const uint64_t slots = uint64_t{num_rings} * slots_per_ring;
  geometry.data_offset = round_up(geometry.chunks_offset + slots * sizeof(ChunkHeader), kPageBytes);
  geometry.total_bytes = geometry.data_offset + slots * round_up(slot_bytes, kPageBytes);
  return geometry;
}

SegmentView SegmentView::initialize(uint8_t* base, const SegmentGeometry& geometry, int owner_rank, int world_size,
                                    const ProcessIdentity& owner, const std::vector<int>& producer_ranks) {
  auto* header = new (base) SegmentHeader();
  header->layout_version = kLayoutVersion;
  header->owner_rank = owner_rank;
  header->world_size = world_size;
  header->owner_pid = owner.pid;
  header->owner_start_time = owner.start_time;
  header->num_rings = geometry.num_rings;
  header->slots_per_ring = geometry.slots_per_ring;
  header->slot_bytes = geometry.slot_bytes;
  header->rings_offset = geometry.rings_offset;
  header->chunks_offset = geometry.chunks_offset;
  header->data_offset = geometry.data_offset;
  header->total_bytes = geometry.total_bytes;
  header->expected_attach = static_cast<uint32_t>(producer_ranks.size());
  SegmentView view(base, geometry);
  for (uint32_t i = 0; i < geometry.num_rings; ++i) {
    auto* ring = new (base + geometry.rings_offset + i * sizeof(RingControl)) RingControl();
    ring->producer_rank = producer_ranks[i];
  }
  header->magic = kSegmentMagic;
  return view;
}

std::optional<SegmentView> SegmentView::validate(uint8_t* base, size_t size) {
  if (size < sizeof(SegmentHeader)) return std::nullopt;
  const auto& header = *reinterpret_cast<const SegmentHeader*>(base);
  if (header.magic != kSegmentMagic || header.layout_version != kLayoutVersion) return std::nullopt;
  // Each field is read once: the segment's other users may be rewriting it while we look.
  const uint32_t num_rings = header.num_rings;
  const uint32_t slots_per_ring = header.slots_per_ring;
  const uint64_t slot_bytes = header.slot_bytes;
  // Far beyond any real job, and small enough that the geometry below cannot overflow 64 bits.
  // (transport_options.cpp allows 2**20 slots in all, at least 2 per ring, of at most 2**30 bytes.)
  if (num_rings == 0 || slots_per_ring == 0 || uint64_t{num_rings} * slots_per_ring > (uint64_t{1} << 21) ||
      slot_bytes == 0 || slot_bytes > (uint64_t{1} << 31)) {
    return std::nullopt;
  }
  const SegmentGeometry expected = SegmentGeometry::compute(num_rings, slots_per_ring, slot_bytes);
  if (expected.rings_offset != header.rings_offset || expected.chunks_offset != header.chunks_offset ||
      expected.data_offset != header.data_offset || expected.total_bytes != header.total_bytes ||
      expected.total_bytes > size) {
    return std::nullopt;
  }
  return SegmentView(base, expected);
}

RingControl& SegmentView::ring(uint32_t ring_index) const {
  return *reinterpret_cast<RingControl*>(base_ + geometry_.rings_offset + ring_index * sizeof(RingControl));
}

ChunkHeader& SegmentView::chunk(uint32_t ring_index, uint64_t slot) const {
  const uint64_t index = uint64_t{ring_index} * geometry_.slots_per_ring + slot;
  return *reinterpret_cast<ChunkHeader*>(base_ + geometry_.chunks_offset + index * sizeof(ChunkHeader));
}

uint8_t* SegmentView::slot_data(uint32_t ring_index, uint64_t slot) const {
  const uint64_t index = uint64_t{ring_index} * geometry_.slots_per_ring + slot;
  return base_ + geometry_.data_offset + index * round_up(geometry_.slot_bytes, kPageBytes);
}

int SegmentView::ring_of(int producer_rank) const {
  for (uint32_t i = 0; i < num_rings(); ++i) {
    if (ring(i).producer_rank == producer_rank) return static_cast<int>(i);
  }
  return -1;
}

ProcessIdentity SegmentView::owner() const {
  ProcessIdentity identity;
  identity.pid = header().owner_pid;
  identity.start_time = header().owner_start_time;
  return identity;
}

}  // namespace mapp
