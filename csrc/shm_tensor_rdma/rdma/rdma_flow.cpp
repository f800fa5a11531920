#include "rdma_flow.h"

#include <stdexcept>
#include <string>

namespace mapp {

uint64_t widen_sequence(uint64_t floor, uint32_t low_bits) {
  const uint32_t ahead = low_bits - static_cast<uint32_t>(floor);  // mod 2**32
  return floor + ahead;
}

RdmaSendWindow::RdmaSendWindow(uint32_t slot_count) : slot_count_(slot_count) {
  if (slot_count == 0) throw std::invalid_argument("an rdma link needs at least one slot");
}

bool RdmaSendWindow::can_claim() const {
  const uint64_t freed = completed_ < credited_ ? completed_ : credited_;
  return claimed_ - freed < slot_count_;
}

uint64_t RdmaSendWindow::claim() {
  if (!can_claim()) throw std::logic_error("no free rdma slot to claim");
  return claimed_++;
}

void RdmaSendWindow::on_write_completed() {
  if (completed_ == claimed_) throw std::logic_error("an rdma write completed that was never posted");
  ++completed_;
}

void RdmaSendWindow::on_credit(uint32_t released_low_bits) {
  const uint64_t released = widen_sequence(credited_, released_low_bits);
  if (released > claimed_) {
    throw std::invalid_argument("credit for " + std::to_string(released) + " chunks, but only " +
                                std::to_string(claimed_) + " were sent (after " + std::to_string(credited_) +
                                " credited)");
  }
  credited_ = released;
}

RdmaSlotReleases::RdmaSlotReleases(uint32_t slot_count) : slot_count_(slot_count), released_(slot_count, false) {
  if (slot_count == 0) throw std::invalid_argument("an rdma link needs at least one slot");
}

uint64_t RdmaSlotReleases::on_arrival(uint32_t sequence_low_bits) {
  if (sequence_low_bits != static_cast<uint32_t>(arrived_)) {
    throw std::invalid_argument("chunk with sequence bits " + std::to_string(sequence_low_bits) +
                                " arrived where chunk " + std::to_string(arrived_) + " was next");
  }
  if (arrived_ - prefix_ >= slot_count_) {
    throw std::invalid_argument("chunk " + std::to_string(arrived_) + " overwrote slot " +
                                std::to_string(slot_of(arrived_)) + " while chunk " + std::to_string(prefix_) +
                                " was still unreleased (the sender ignored flow control)");
  }
  return arrived_++;
}

void RdmaSlotReleases::release(uint64_t sequence) {
  if (sequence < prefix_ || sequence >= arrived_ || released_[slot_of(sequence)]) {
    throw std::invalid_argument("release of chunk " + std::to_string(sequence) + ", which is not held (arrived " +
                                std::to_string(arrived_) + ", released up to " + std::to_string(prefix_) + ")");
  }
  released_[slot_of(sequence)] = true;
  while (prefix_ < arrived_ && released_[slot_of(prefix_)]) {
    released_[slot_of(prefix_)] = false;
    ++prefix_;
  }
}

RdmaCreditReturn::RdmaCreditReturn(uint32_t batch, uint32_t max_in_flight)
    : batch_(batch), max_in_flight_(max_in_flight) {
  if (batch == 0 || max_in_flight == 0) throw std::invalid_argument("credit batch and in-flight limit must be >= 1");
}

std::optional<uint64_t> RdmaCreditReturn::due(uint64_t released_prefix, bool idle) {
  if (released_prefix < returned_) {
    throw std::invalid_argument("released count went back from " + std::to_string(returned_) + " to " +
                                std::to_string(released_prefix));
  }
  const uint64_t pending = released_prefix - returned_;
  if (pending == 0 || in_flight_ >= max_in_flight_) return std::nullopt;
  if (pending < batch_ && !idle) return std::nullopt;
  returned_ = released_prefix;
  ++in_flight_;
  return returned_;
}

void RdmaCreditReturn::on_send_completed() {
  if (in_flight_ == 0) throw std::logic_error("a credit send completed that was never posted");
  --in_flight_;
}

}  // namespace mapp
