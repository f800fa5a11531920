#include "shm_receiver.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "shm_names.h"
#include "stream_copy.h"

namespace mapp {
namespace {

SegmentView create_segment(const ReceiverConfig& config, std::unique_ptr<ShmSegment>* segment) {
  if (config.peers.empty()) throw std::invalid_argument("a receive segment needs at least one peer");
  const uint32_t rings = static_cast<uint32_t>(config.peers.size());
  const uint32_t slots_per_ring = std::max<uint32_t>(2, config.num_slots / rings);
  const SegmentGeometry geometry = SegmentGeometry::compute(rings, slots_per_ring, config.slot_bytes);
  reclaim_segment_name(config.job_id, config.rank);
  *segment = ShmSegment::create_unpublished(segment_name(config.job_id, config.rank), geometry.total_bytes);
  return SegmentView::initialize((*segment)->data(), geometry, config.rank, config.world_size,
                                 ProcessIdentity::self(), config.peers);
}

}  // namespace

ShmReceiver::ShmReceiver(const ReceiverConfig& config, Inbox* inbox, std::shared_ptr<BufferPool> pool)
    : inbox_(inbox),
      pool_(std::move(pool)),
      view_(create_segment(config, &segment_)),
      foreground_(&view_.header().foreground),
      background_(&view_.header().background),
      partial_(view_.num_rings()) {
  segment_->publish();
  drain_thread_ = std::thread([this] { drain_loop(); });
}

ShmReceiver::~ShmReceiver() { close(); }

void ShmReceiver::close() {
  if (stopping_.exchange(true)) return;
  background_.ring();
  if (drain_thread_.joinable()) drain_thread_.join();
  std::lock_guard<std::mutex> lock(drain_mutex_);
  closed_ = true;
  view_.header().closed.store(1, std::memory_order_seq_cst);
  foreground_.ring();
  // Wake producers blocked on full rings so they see `closed` now rather than at their next tick.
  for (uint32_t i = 0; i < view_.num_rings(); ++i) Doorbell(&view_.ring(i).space).ring();
  segment_->unlink_name();
}

void ShmReceiver::drain_loop() {
  // No timeout needed: close() rings the bell. The long timeout is only a safety net.
  while (!stopping_.load(std::memory_order_acquire)) {
    const uint32_t seen = background_.snapshot();
    drain_available();
    if (stopping_.load(std::memory_order_acquire)) break;
    background_.wait(seen, std::chrono::seconds(5));
  }
}

void ShmReceiver::drain_available(bool wait_for_lock) {
  std::unique_lock<std::mutex> lock(drain_mutex_, std::defer_lock);
  if (wait_for_lock) {
    lock.lock();
  } else if (!lock.try_lock()) {
    return;
  }
  if (closed_) return;
  for (uint32_t i = 0; i < view_.num_rings(); ++i) drain_ring(i);
}

void ShmReceiver::drain_ring(uint32_t ring_index) {
  RingControl& ring = view_.ring(ring_index);
  Doorbell space(&ring.space);
  PartialMessage& partial = partial_[ring_index];
  const uint64_t slots = view_.slots_per_ring();
  uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  const uint64_t head = ring.head.load(std::memory_order_acquire);
  for (; tail < head; ++tail) {
    const uint64_t slot = tail % slots;
    const ChunkHeader chunk = view_.chunk(ring_index, slot);
    // A malformed chunk can only come from a corrupted segment; drop it rather than write out of bounds.
    const bool valid = chunk.length <= view_.slot_bytes() && chunk.offset <= chunk.message.nbytes &&
                       chunk.length <= chunk.message.nbytes - chunk.offset && chunk.message.ndim <= kMaxDims;
    if (valid) {
      if (chunk.offset == 0) {
        partial.active = true;
        partial.header = chunk.message;
        partial.payload = pool_->acquire(chunk.message.nbytes);
      }
      if (partial.active && chunk.length > 0) {
        copy_bypassing_cache(partial.payload.data() + chunk.offset, view_.slot_data(ring_index, slot), chunk.length);
      }
    }
    ring.tail.store(tail + 1, std::memory_order_release);
    space.ring();
    if (valid && partial.active && chunk.offset + chunk.length == chunk.message.nbytes) {
      partial.active = false;
      inbox_->put(ring.producer_rank, Message{partial.header, std::move(partial.payload)});
      foreground_.ring();  // cheap when nobody waits
    }
  }
}

bool ShmReceiver::producer_closed(int peer) const {
  const int ring_index = view_.ring_of(peer);
  return ring_index >= 0 && view_.ring(static_cast<uint32_t>(ring_index)).producer_closed.load() != 0;
}

bool ShmReceiver::has_undrained_chunks() const {
  for (uint32_t i = 0; i < view_.num_rings(); ++i) {
    const RingControl& ring = view_.ring(i);
    if (ring.head.load(std::memory_order_seq_cst) != ring.tail.load(std::memory_order_seq_cst)) return true;
  }
  return false;
}

ShmReceiver::ForegroundWait::ForegroundWait(ShmReceiver& receiver) : receiver_(receiver) {
  receiver_.view_.header().foreground_waiters.fetch_add(1, std::memory_order_seq_cst);
}

ShmReceiver::ForegroundWait::~ForegroundWait() {
  receiver_.view_.header().foreground_waiters.fetch_sub(1, std::memory_order_seq_cst);
  // A producer that still saw us waiting rang only our bell: hand its chunks to the drain thread.
  if (receiver_.has_undrained_chunks()) receiver_.background_.ring();
}

std::optional<ProcessIdentity> ShmReceiver::producer(int peer) const {
  const int ring_index = view_.ring_of(peer);
  if (ring_index < 0) return std::nullopt;
  const RingControl& ring = view_.ring(static_cast<uint32_t>(ring_index));
  ProcessIdentity identity;
  identity.pid = ring.producer_pid.load(std::memory_order_acquire);
  if (identity.pid == 0) return std::nullopt;
  identity.start_time = ring.producer_start_time.load(std::memory_order_acquire);
  return identity;
}

}  // namespace mapp
