#include "shm_channel.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "doorbell.h"
#include "errors.h"
#include "peer_name.h"
#include "shm_names.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {
namespace {

using Clock = std::chrono::steady_clock;
// How often a sender blocked on a full ring re-checks that the receiver is alive.
constexpr auto kLivenessInterval = kWaitTick;
// A message is cut into about this many chunks, so copy-in and copy-out overlap for all but one chunk...
constexpr uint64_t kChunksPerMessage = 8;
// ...but no chunk is smaller than this (unless the message is): each chunk costs a doorbell and a receiver pass.
constexpr uint64_t kMinChunkBytes = 64 * 1024;
constexpr uint64_t kChunkAlignBytes = 4096;

uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

std::unique_ptr<ShmChannel> ShmChannel::attach(const std::string& job_id, int my_rank, int world_size,
                                               int peer_rank) {
  std::unique_ptr<ShmSegment> segment = ShmSegment::open_existing(segment_name(job_id, peer_rank));
  if (!segment) return nullptr;
  std::optional<SegmentView> view = SegmentView::validate(segment->data(), segment->size());
  if (!view || !view->owner().alive()) return nullptr;  // stale leftover; its new owner will replace it
  if (view->header().owner_rank != peer_rank) {
    throw std::runtime_error("segment " + segment->name() + " belongs to rank " +
                             std::to_string(view->header().owner_rank) + ", not rank " + std::to_string(peer_rank));
  }
  if (view->header().world_size != world_size) {
    throw std::runtime_error("rank " + std::to_string(peer_rank) + " was started with world_size " +
                             std::to_string(view->header().world_size) + " but rank " + std::to_string(my_rank) +
                             " with world_size " + std::to_string(world_size));
  }
  const int ring_index = view->ring_of(my_rank);
  if (ring_index < 0) {
    throw std::runtime_error("rank " + std::to_string(peer_rank) + " does not list rank " + std::to_string(my_rank) +
                             " among its peers (peers must be listed symmetrically)");
  }
  RingControl& ring = view->ring(static_cast<uint32_t>(ring_index));
  const ProcessIdentity me = ProcessIdentity::self();
  ring.producer_start_time.store(me.start_time, std::memory_order_release);
  ring.producer_pid.store(me.pid, std::memory_order_release);
  // Once every expected producer holds a mapping the name is no longer needed: removing it now means the kernel
  // frees the memory even if every process of the job is killed.
  const uint32_t attached = view->header().attached.fetch_add(1, std::memory_order_acq_rel) + 1;
  if (attached >= view->header().expected_attach) segment->unlink_name();
  return std::unique_ptr<ShmChannel>(
      new ShmChannel(std::move(segment), *view, static_cast<uint32_t>(ring_index), peer_rank));
}

ShmChannel::ShmChannel(std::unique_ptr<ShmSegment> segment, SegmentView view, uint32_t ring_index, int peer_rank)
    : segment_(std::move(segment)),
      view_(view),
      ring_(view.ring(ring_index)),
      ring_index_(ring_index),
      peer_rank_(peer_rank),
      owner_(view.owner()) {}

uint64_t ShmChannel::chunk_bytes_for(uint64_t nbytes) const {
  const uint64_t share = round_up((nbytes + kChunksPerMessage - 1) / kChunksPerMessage, kChunkAlignBytes);
  return std::min(std::max(share, kMinChunkBytes), view_.slot_bytes());
}

bool ShmChannel::ring_full() const {
  return ring_.head.load(std::memory_order_relaxed) - ring_.tail.load(std::memory_order_acquire) >=
         view_.slots_per_ring();
}

uint64_t ShmChannel::publish_chunk(const OutgoingMessage& message, uint64_t offset) {
  const uint64_t head = ring_.head.load(std::memory_order_relaxed);
  if (offset == 0) {
    // A receiver still copying earlier chunks overlaps with us anyway; small chunks would only fill the ring's
    // slots sooner (back-to-back 256 KiB messages lost 0.6x of their bandwidth that way): use whole slots.
    const bool receiver_behind = head != ring_.tail.load(std::memory_order_acquire);
    chunk_bytes_ = receiver_behind ? view_.slot_bytes() : chunk_bytes_for(message.header.nbytes);
  }
  const uint64_t length = std::min(chunk_bytes_, message.header.nbytes - offset);
  const uint64_t slot = head % view_.slots_per_ring();
  ChunkHeader& chunk = view_.chunk(ring_index_, slot);
  chunk.message = message.header;
  chunk.offset = offset;
  chunk.length = length;
  if (length > 0) std::memcpy(view_.slot_data(ring_index_, slot), message.data + offset, length);
  ring_.head.store(head + 1, std::memory_order_seq_cst);
  notify_chunk_published(view_.header());  // per chunk: the receiver copies it out while we copy in the next
  return length;
}

bool ShmChannel::send_now(const OutgoingMessage& message, uint64_t* offset, uint64_t until) {
  if (owner_closed() || leased_ != 0) return false;
  for (;;) {
    if (ring_full()) return false;
    *offset += publish_chunk(message, *offset);
    if (*offset >= message.header.nbytes) return true;
    if (*offset >= until) return false;
  }
}

SlotLease ShmChannel::reserve(const OutgoingMessage& message, uint64_t offset, const SendLimits& limits) {
  if (owner_closed()) {
    throw ClosedError(peer_name(peer_rank_) + " closed its transport before rank " +
                      std::to_string(limits.my_rank) + " sent " + describe_tag(message.header.tag));
  }
  if (offset > message.header.nbytes || (offset == message.header.nbytes && offset != 0)) {
    throw std::invalid_argument("slot lease at byte " + std::to_string(offset) + " of a " +
                                std::to_string(message.header.nbytes) + "-byte message");
  }
  // Each lease costs its filler a round of calls (reserve, copy, event, commit: tens of microseconds from
  // Python), so leases are as large as they can be while two of them still overlap: half the message, at least
  // 64 KiB, at most a slot.
  if (offset == 0) {
    const uint64_t half = round_up((message.header.nbytes + 1) / 2, kChunkAlignBytes);
    chunk_bytes_ = std::min(std::max(half, kMinChunkBytes), view_.slot_bytes());
  }
  wait_for_free_slot(message, limits, leased_);
  const uint64_t index = ring_.head.load(std::memory_order_relaxed) + leased_;
  const uint64_t slot = index % view_.slots_per_ring();
  const uint64_t length = std::min(chunk_bytes_, message.header.nbytes - offset);
  ChunkHeader& chunk = view_.chunk(ring_index_, slot);
  chunk.message = message.header;
  chunk.offset = offset;
  chunk.length = length;
  ++leased_;
  return SlotLease{view_.slot_data(ring_index_, slot), length};
}

void ShmChannel::commit() {
  if (leased_ == 0) throw std::logic_error("commit without a leased slot");
  const uint64_t head = ring_.head.load(std::memory_order_relaxed);
  ring_.head.store(head + 1, std::memory_order_seq_cst);
  --leased_;
  notify_chunk_published(view_.header());
}

SlotRegion ShmChannel::slot_region() const {
  uint8_t* first = view_.slot_data(ring_index_, 0);
  // Whole pages (the last slot's padding lies inside the mapping): what cudaHostRegister pins is page-granular.
  const uint8_t* end =
      view_.slot_data(ring_index_, view_.slots_per_ring() - 1) + round_up(view_.slot_bytes(), kChunkAlignBytes);
  return SlotRegion{first, static_cast<uint64_t>(end - first)};
}

void ShmChannel::send(const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) {
  if (leased_ != 0) throw std::logic_error("send on a channel with leased slots");
  if (owner_closed()) {
    throw ClosedError(peer_name(peer_rank_) + " closed its transport before rank " +
                      std::to_string(limits.my_rank) + " sent " + describe_tag(message.header.tag));
  }
  do {
    wait_for_free_slot(message, limits);
    offset += publish_chunk(message, offset);
  } while (offset < message.header.nbytes);
}

void ShmChannel::wait_for_free_slot(const OutgoingMessage& message, const SendLimits& limits, uint64_t ahead) {
  Doorbell space(&ring_.space);
  const auto give_up_at = deadline_after(limits.timeout_s);
  auto next_liveness_check = Clock::now();  // check at once: queued sends to a dead peer fail without delay
  const auto what = [&] {
    return "rank " + std::to_string(limits.my_rank) + " was sending " + describe_tag(message.header.tag) +
           " to " + peer_name(peer_rank_);
  };
  for (;;) {
    const uint32_t seen = space.snapshot();
    const uint64_t head = ring_.head.load(std::memory_order_relaxed);
    if (head + ahead - ring_.tail.load(std::memory_order_acquire) < view_.slots_per_ring()) return;
    if (limits.stopping->load(std::memory_order_acquire)) throw ClosedError("transport closed while " + what());
    if (owner_closed()) {
      throw ClosedError(peer_name(peer_rank_) + " closed its transport while " + what());
    }
    const auto now = Clock::now();
    if (now >= next_liveness_check) {
      if (!owner_.alive()) {
        throw PeerDiedError(peer_name(peer_rank_) + " (pid " + std::to_string(owner_.pid) +
                            ") died while " + what());
      }
      next_liveness_check = now + kLivenessInterval;
    }
    if (now >= give_up_at) {
      throw TimeoutError("timed out after " + format_seconds(limits.timeout_s) + " waiting for free slots while " +
                         what());
    }
    // The receiver frees a slot about once per chunk copy: polling briefly usually catches it without a wake-up.
    space.spin_wait(seen, kSpinBeforeSleep, std::min<Clock::duration>(next_liveness_check - now, give_up_at - now));
  }
}

void ShmChannel::wake_sender() { Doorbell(&ring_.space).ring(); }

void ShmChannel::mark_producer_closed() {
  ring_.producer_closed.store(1, std::memory_order_seq_cst);
  Doorbell(&view_.header().foreground).ring();  // a receiver blocked on us re-checks now
}

}  // namespace mapp
