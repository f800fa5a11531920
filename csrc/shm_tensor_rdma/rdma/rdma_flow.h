// Credit-based flow control of one RDMA link (no verbs types: always compiled, unit-tested).
//
// The receiver owns a ring of slot_count slots; the sender may write chunk `sequence` into slot
// sequence % slot_count only once the receiver has released the chunk that used the slot before
// (sequence - slot_count). The receiver returns credits as the cumulative number of chunks released in sequence
// order, batched, in the 32-bit immediate of a small SEND; the sender widens them back to 64 bits.
//
//   sender:   RdmaSendWindow     claim() a sequence when can_claim(); on_write_completed(); on_credit(imm)
//   receiver: RdmaSlotReleases   on_arrival(imm) -> sequence; release(sequence) in any order; released_prefix()
//             RdmaCreditReturn   due(prefix, idle) -> the count to send now, if any; on_send_completed()
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mapp {

// The sender's side. A slot is free when the receiver released its previous chunk (credit) and the local write
// out of the matching staging slot completed (the staging buffer mirrors the ring).
class RdmaSendWindow {
 public:
  explicit RdmaSendWindow(uint32_t slot_count);
  bool can_claim() const;
  // The next chunk's sequence. Throws std::logic_error when !can_claim().
  uint64_t claim();
  uint32_t slot_of(uint64_t sequence) const { return static_cast<uint32_t>(sequence % slot_count_); }
  // One posted write completed (writes on one queue pair complete in order). Throws std::logic_error if none
  // was outstanding.
  void on_write_completed();
  // A credit message: the low 32 bits of the receiver's released count. Throws std::invalid_argument for a count
  // that goes backwards or covers chunks never sent.
  void on_credit(uint32_t released_low_bits);
  // Every claimed chunk's write completed.
  bool writes_done() const { return completed_ == claimed_; }
  uint64_t claimed() const { return claimed_; }
  uint64_t completed() const { return completed_; }
  uint64_t credited() const { return credited_; }
  uint32_t slot_count() const { return slot_count_; }

 private:
  uint32_t slot_count_;
  uint64_t claimed_ = 0;
  uint64_t completed_ = 0;
  uint64_t credited_ = 0;
};

// The receiver's side: which chunks arrived and which of them it finished with.
class RdmaSlotReleases {
 public:
  explicit RdmaSlotReleases(uint32_t slot_count);
  // A chunk arrived with this immediate; returns its sequence. Throws std::invalid_argument if it is not the next
  // one, or if it landed in a slot still holding an unreleased chunk (the sender ignored flow control).
  uint64_t on_arrival(uint32_t sequence_low_bits);
  // Throws std::invalid_argument for a chunk that did not arrive or was released already.
  void release(uint64_t sequence);
  // Every chunk below this is released: the cumulative credit.
  uint64_t released_prefix() const { return prefix_; }
  uint64_t arrived() const { return arrived_; }
  uint32_t slot_of(uint64_t sequence) const { return static_cast<uint32_t>(sequence % slot_count_); }

 private:
  uint32_t slot_count_;
  uint64_t arrived_ = 0;
  uint64_t prefix_ = 0;
  std::vector<bool> released_;  // by slot, for sequences in [prefix_, arrived_)
};

// When the receiver sends a credit message: once `batch` more chunks are released, or whenever anything is
// unreturned and the receiver is idle (so a sender waiting for the last few slots never waits forever), and only
// while fewer than `max_in_flight` credit messages are unacknowledged (the send queue's share for credits).
class RdmaCreditReturn {
 public:
  RdmaCreditReturn(uint32_t batch, uint32_t max_in_flight);
  // The cumulative count to send now (and counts that message in flight), or nothing.
  std::optional<uint64_t> due(uint64_t released_prefix, bool idle);
  // A credit message's send completed. Throws std::logic_error if none was in flight.
  void on_send_completed();
  uint64_t returned() const { return returned_; }
  uint32_t in_flight() const { return in_flight_; }

 private:
  uint32_t batch_;
  uint32_t max_in_flight_;
  uint64_t returned_ = 0;
  uint32_t in_flight_ = 0;
};

// The 64-bit counter value whose low 32 bits are `low_bits`, at or above `floor` and less than 2**32 above it.
uint64_t widen_sequence(uint64_t floor, uint32_t low_bits);

}  // namespace mapp
