// How a message travels through the RDMA slot ring (no verbs types: always compiled, unit-tested).
// A message is cut into chunks that each fill at most one slot: a RdmaChunkHeader, then up to
// slot_bytes - sizeof(RdmaChunkHeader) payload bytes. The sender writes a chunk into the receiver's slot
// sequence % slot_count with RDMA WRITE WITH IMMEDIATE (immediate = low 32 bits of the sequence). One RC queue pair
// delivers writes in order, so the receiver assembles each message from consecutive chunks and treats a gap, a
// repeated sequence or a chunk that does not continue the message as a protocol violation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "buffer_pool.h"
#include "inbox.h"
#include "message.h"

namespace mapp {

constexpr uint32_t kRdmaChunkMagic = 0x4B48434Du;  // "MCHK"

// Both ends run the same build, so the header goes as it is in memory (as tcp_frame.h does).
struct RdmaChunkHeader {
  uint32_t magic;
  uint32_t reserved;
  uint64_t sequence;       // chunk number on this link, from 0
  uint64_t message_index;  // message number on this link, from 0
  uint64_t offset;         // where this chunk's bytes go in the message
  uint64_t length;         // payload bytes after the header
  MessageHeader message;
};

// Payload bytes one slot carries. Throws std::invalid_argument if the slot cannot hold a header and one byte.
uint64_t rdma_slot_payload_bytes(uint64_t slot_bytes);
// Chunks a message of `nbytes` needs (an empty message still takes one).
uint64_t rdma_chunk_count(uint64_t nbytes, uint64_t payload_per_slot);

// The sender's view of one message: writes chunk i into a slot.
class RdmaChunker {
 public:
  RdmaChunker(const MessageHeader& message, const uint8_t* payload, uint64_t slot_bytes, uint64_t message_index);
  uint64_t count() const { return count_; }
  // Writes chunk `index` (header and payload) to `slot` as link chunk `sequence`; returns the bytes written, which
  // is what the RDMA write must carry.
  size_t write(uint64_t index, uint64_t sequence, uint8_t* slot) const;

 private:
  MessageHeader message_;
  const uint8_t* payload_;
  uint64_t payload_per_slot_;
  uint64_t message_index_;
  uint64_t count_;
};

// Reads and checks the chunk in a slot that received `byte_len` bytes as link chunk `sequence`.
// Throws std::invalid_argument naming the violation.
RdmaChunkHeader read_rdma_chunk(const uint8_t* slot, size_t byte_len, uint64_t sequence, uint64_t slot_bytes,
                                uint64_t max_message_bytes);

// The receiver's view of one link: copies each arriving chunk out of its slot into the message's buffer (after
// which the slot may be reused) and hands back every message it completes.
class RdmaMessageAssembler {
 public:
  RdmaMessageAssembler(std::shared_ptr<BufferPool> pool, uint64_t slot_bytes, uint64_t max_message_bytes);
  // Throws std::invalid_argument for a protocol violation; the link is unusable afterwards.
  std::optional<Message> accept(const uint8_t* slot, size_t byte_len, uint64_t sequence);
  // A message is partly here (a peer that goes away now leaves it incomplete).
  bool mid_message() const { return current_.has_value(); }

 private:
  struct Partial {
    MessageHeader header;
    PooledBuffer payload;
    uint64_t received;
  };

  std::shared_ptr<BufferPool> pool_;
  uint64_t slot_bytes_;
  uint64_t max_message_bytes_;
  uint64_t next_message_index_ = 0;
  std::optional<Partial> current_;
};

}  // namespace mapp
