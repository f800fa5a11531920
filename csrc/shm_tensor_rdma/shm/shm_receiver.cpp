#include "shm_receiver.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "peer_name.h"
#include "shm_names.h"
#include "tag.h"
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
      rank_(config.rank),
      max_message_bytes_(config.max_message_bytes),
      partial_(view_.num_rings()) {
  for (int peer : config.peers) rings_.push_back(RingState{peer});
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

std::string ShmReceiver::chunk_problem(const ChunkHeader& chunk, const PartialMessage& partial) const {
  const std::string header_problem = message_header_problem(chunk.message, max_message_bytes_);
  if (!header_problem.empty()) return "a chunk describing " + header_problem;
  const uint64_t expected_offset = partial.active ? partial.received : 0;
  if (chunk.offset != expected_offset) {
    return "a chunk at byte " + std::to_string(chunk.offset) + " where byte " + std::to_string(expected_offset) +
           " comes next";
  }
  if (partial.active && std::memcmp(&chunk.message, &partial.header, sizeof(MessageHeader)) != 0) {
    return "a chunk of another message inside " + describe_tag(partial.header.tag);
  }
  // A sender fills every chunk it publishes; only an empty message has an empty chunk.
  if (chunk.length > view_.slot_bytes() || chunk.length > chunk.message.nbytes - chunk.offset ||
      (chunk.length == 0 && chunk.message.nbytes != 0)) {
    return "a chunk of " + std::to_string(chunk.length) + " bytes at byte " + std::to_string(chunk.offset) +
           " of a " + std::to_string(chunk.message.nbytes) + "-byte message in a " +
           std::to_string(view_.slot_bytes()) + "-byte slot";
  }
  return "";
}

void ShmReceiver::drain_ring(uint32_t ring_index) {
  RingControl& ring = view_.ring(ring_index);
  RingState& state = rings_[ring_index];
  if (!state.corruption.empty() || state.held) return;  // held: a claimed message's chunks wait for its taker
  Doorbell space(&ring.space);
  PartialMessage& partial = partial_[ring_index];
  const uint64_t slots = view_.slots_per_ring();
  const uint64_t head = ring.head.load(std::memory_order_acquire);
  const auto fail_ring = [&](const std::string& what) {
    this->fail_ring(ring_index, peer_name(state.producer_rank) + " wrote " + what + " into the shared memory of rank " +
                                    std::to_string(rank_) + " (a corrupted segment or a stranger); its link is closed");
  };
  // A producer is never more than a ring ahead of us, and never behind: anything else is not a sender's head.
  if (head - state.consumed > slots) {
    fail_ring("ring head " + std::to_string(head) + " with " + std::to_string(state.consumed) + " of " +
              std::to_string(slots) + " slots consumed");
    return;
  }
  for (; state.consumed < head; ++state.consumed) {
    const uint64_t slot = state.consumed % slots;
    const ChunkHeader chunk = view_.chunk(ring_index, slot);  // one copy: the producer may rewrite the original
    const std::string problem = chunk_problem(chunk, partial);
    if (!problem.empty()) {
      fail_ring(problem);
      return;
    }
    if (chunk.offset == 0 && state.claimed && chunk.message.tag == state.claim_tag) {
      state.held = true;  // left in its slots for the claimer (next_claimed)
      state.claim_header = chunk.message;
      foreground_.ring();
      return;
    }
    if (chunk.offset == 0) {
      partial.active = true;
      partial.header = chunk.message;
      partial.payload = pool_->acquire(chunk.message.nbytes);
      partial.received = 0;
    }
    if (chunk.length > 0) {
      copy_bypassing_cache(partial.payload.data() + chunk.offset, view_.slot_data(ring_index, slot), chunk.length);
    }
    partial.received += chunk.length;
    ring.tail.store(state.consumed + 1, std::memory_order_release);
    space.ring();
    if (partial.received == partial.header.nbytes) {
      partial.active = false;
      inbox_->put(state.producer_rank, Message{partial.header, std::move(partial.payload)});
      foreground_.ring();  // cheap when nobody waits
    }
  }
}

void ShmReceiver::fail_ring(uint32_t ring_index, const std::string& what) {
  RingState& state = rings_[ring_index];
  state.corruption = what;
  state.claimed = state.held = false;
  partial_[ring_index] = PartialMessage{};
  foreground_.ring();  // a receiver blocked on this peer reports it now
}

uint32_t ShmReceiver::ring_of_peer(int peer, const char* action) const {
  const int ring_index = ring_index_of(peer);
  if (ring_index < 0) throw std::invalid_argument("cannot " + std::string(action) + ": " + peer_name(peer) +
                                                  " sends nothing to rank " + std::to_string(rank_));
  return static_cast<uint32_t>(ring_index);
}

bool ShmReceiver::claim(int peer, uint64_t tag) {
  const uint32_t ring_index = ring_of_peer(peer, "claim a receive");
  std::lock_guard<std::mutex> lock(drain_mutex_);
  if (closed_) return false;
  for (uint32_t i = 0; i < view_.num_rings(); ++i) drain_ring(i);  // what has arrived goes the ordinary way
  RingState& state = rings_[ring_index];
  const PartialMessage& partial = partial_[ring_index];
  if (!state.corruption.empty() || state.claimed || (partial.active && partial.header.tag == tag)) return false;
  state.claimed = true;
  state.claim_tag = tag;
  state.held = false;
  state.handed_out = state.handed_bytes = state.chunks_seen = 0;
  // A partial message of another tag completes first (its remaining chunks are drained as they come); the claimed
  // message's first chunk can only follow it.
  return true;
}

std::optional<ReceivedChunk> ShmReceiver::next_claimed(int peer) {
  const uint32_t ring_index = ring_of_peer(peer, "take a claimed receive");
  std::lock_guard<std::mutex> lock(drain_mutex_);
  if (closed_) return std::nullopt;
  for (uint32_t i = 0; i < view_.num_rings(); ++i) drain_ring(i);  // the held ring is skipped
  RingState& state = rings_[ring_index];
  if (!state.claimed) {
    if (!state.corruption.empty()) return std::nullopt;  // failure() reports it
    throw std::logic_error("next_claimed_chunk without a claim on " + peer_name(peer));
  }
  if (!state.held) return std::nullopt;
  if (state.chunks_seen > 0 && state.handed_bytes == state.claim_header.nbytes) {
    throw std::logic_error("next_claimed_chunk after the claimed message's last chunk");
  }
  RingControl& ring = view_.ring(ring_index);
  const uint64_t slots = view_.slots_per_ring();
  const uint64_t head = ring.head.load(std::memory_order_acquire);
  const uint64_t index = state.consumed + state.handed_out;
  if (head - state.consumed > slots) {
    fail_ring(ring_index, peer_name(peer) + " wrote ring head " + std::to_string(head) + " with " +
                              std::to_string(state.consumed) + " of " + std::to_string(slots) +
                              " slots consumed into the shared memory of rank " + std::to_string(rank_) +
                              " (a corrupted segment or a stranger); its link is closed");
    return std::nullopt;
  }
  if (index >= head) return std::nullopt;
  const uint64_t slot = index % slots;
  const ChunkHeader chunk = view_.chunk(ring_index, slot);  // one copy: the producer may rewrite the original
  PartialMessage expected;
  expected.active = true;
  expected.header = state.claim_header;
  expected.received = state.handed_bytes;
  const std::string problem = chunk_problem(chunk, expected);
  if (!problem.empty()) {
    fail_ring(ring_index, peer_name(peer) + " wrote " + problem + " into the shared memory of rank " +
                              std::to_string(rank_) + " (a corrupted segment or a stranger); its link is closed");
    return std::nullopt;
  }
  ++state.handed_out;
  ++state.chunks_seen;
  state.handed_bytes += chunk.length;
  return ReceivedChunk{chunk.message, chunk.offset, chunk.length, view_.slot_data(ring_index, slot)};
}

bool ShmReceiver::release_claimed(int peer) {
  const uint32_t ring_index = ring_of_peer(peer, "release a claimed chunk");
  std::lock_guard<std::mutex> lock(drain_mutex_);
  RingState& state = rings_[ring_index];
  if (!state.held || state.handed_out == 0) {
    if (!state.corruption.empty() || closed_) return true;  // the link failed meanwhile: nothing to free
    throw std::logic_error("release_claimed_chunk without a chunk handed out from " + peer_name(peer));
  }
  RingControl& ring = view_.ring(ring_index);
  ++state.consumed;
  --state.handed_out;
  ring.tail.store(state.consumed, std::memory_order_release);
  Doorbell(&ring.space).ring();
  if (state.handed_out > 0 || state.handed_bytes != state.claim_header.nbytes) return false;
  state.claimed = state.held = false;  // the message is taken: the ring drains the ordinary way again
  background_.ring();
  return true;
}

void ShmReceiver::cancel_claim(int peer) {
  const uint32_t ring_index = ring_of_peer(peer, "cancel a claimed receive");
  std::lock_guard<std::mutex> lock(drain_mutex_);
  RingState& state = rings_[ring_index];
  if (!state.claimed) return;
  if (state.chunks_seen == 0) {
    state.claimed = state.held = false;  // nothing taken: a message already held is copied out as usual
    background_.ring();
    foreground_.ring();
    return;
  }
  fail_ring(ring_index, "rank " + std::to_string(rank_) + " abandoned " + describe_tag(state.claim_header.tag) +
                            " from " + peer_name(peer) + " after " + std::to_string(state.handed_bytes) + " of " +
                            std::to_string(state.claim_header.nbytes) +
                            " bytes taken straight from its slots; its link is closed");
}

SlotRegion ShmReceiver::receive_region(int peer) const {
  const uint32_t ring_index = ring_of_peer(peer, "lend receive slots");
  uint8_t* first = view_.slot_data(ring_index, 0);
  constexpr uint64_t kPage = 4096;
  const uint64_t slot_span = (view_.slot_bytes() + kPage - 1) / kPage * kPage;
  const uint8_t* end = view_.slot_data(ring_index, view_.slots_per_ring() - 1) + slot_span;
  return SlotRegion{first, static_cast<uint64_t>(end - first)};
}

std::optional<std::string> ShmReceiver::corruption(int peer) {
  const int ring_index = ring_index_of(peer);
  if (ring_index < 0) return std::nullopt;
  std::lock_guard<std::mutex> lock(drain_mutex_);
  const std::string& text = rings_[static_cast<size_t>(ring_index)].corruption;
  if (text.empty()) return std::nullopt;
  return text;
}

int ShmReceiver::ring_index_of(int peer) const {
  for (size_t i = 0; i < rings_.size(); ++i) {
    if (rings_[i].producer_rank == peer) return static_cast<int>(i);
  }
  return -1;
}

bool ShmReceiver::producer_closed(int peer) const {
  const int ring_index = ring_index_of(peer);
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
  const int ring_index = ring_index_of(peer);
  if (ring_index < 0) return std::nullopt;
  const RingControl& ring = view_.ring(static_cast<uint32_t>(ring_index));
  ProcessIdentity identity;
  identity.pid = ring.producer_pid.load(std::memory_order_acquire);
  if (identity.pid == 0) return std::nullopt;
  identity.start_time = ring.producer_start_time.load(std::memory_order_acquire);
  return identity;
}

}  // namespace mapp
