#include "rdma_chunk.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tag.h"

namespace mapp {

uint64_t rdma_slot_payload_bytes(uint64_t slot_bytes) {
  if (slot_bytes <= sizeof(RdmaChunkHeader)) {
    throw std::invalid_argument("rdma slot of " + std::to_string(slot_bytes) + " bytes cannot hold a " +
                                std::to_string(sizeof(RdmaChunkHeader)) + "-byte chunk header and any payload");
  }
  return slot_bytes - sizeof(RdmaChunkHeader);
}

uint64_t rdma_chunk_count(uint64_t nbytes, uint64_t payload_per_slot) {
  if (payload_per_slot == 0) throw std::invalid_argument("payload per slot must be positive");
  return nbytes == 0 ? 1 : (nbytes + payload_per_slot - 1) / payload_per_slot;
}

RdmaChunker::RdmaChunker(const MessageHeader& message, const uint8_t* payload, uint64_t slot_bytes,
                         uint64_t message_index)
    : message_(message),
      payload_(payload),
      payload_per_slot_(rdma_slot_payload_bytes(slot_bytes)),
      message_index_(message_index),
      count_(rdma_chunk_count(message.nbytes, payload_per_slot_)) {}

size_t RdmaChunker::write(uint64_t index, uint64_t sequence, uint8_t* slot) const {
  if (index >= count_) {
    throw std::out_of_range("chunk " + std::to_string(index) + " of a " + std::to_string(count_) + "-chunk message");
  }
  RdmaChunkHeader header;
  std::memset(&header, 0, sizeof(header));
  header.magic = kRdmaChunkMagic;
  header.sequence = sequence;
  header.message_index = message_index_;
  header.offset = index * payload_per_slot_;
  header.length = std::min(payload_per_slot_, message_.nbytes - header.offset);
  header.message = message_;
  std::memcpy(slot, &header, sizeof(header));
  if (header.length > 0) std::memcpy(slot + sizeof(header), payload_ + header.offset, header.length);
  return sizeof(header) + header.length;
}

RdmaChunkHeader read_rdma_chunk(const uint8_t* slot, size_t byte_len, uint64_t sequence, uint64_t slot_bytes,
                                uint64_t max_message_bytes) {
  if (byte_len < sizeof(RdmaChunkHeader)) {
    throw std::invalid_argument("chunk " + std::to_string(sequence) + " has " + std::to_string(byte_len) +
                                " bytes, less than its header");
  }
  RdmaChunkHeader header;
  std::memcpy(&header, slot, sizeof(header));
  const std::string which = "chunk " + std::to_string(sequence);
  if (header.magic != kRdmaChunkMagic) throw std::invalid_argument(which + " is corrupt (bad magic)");
  if (header.sequence != sequence) {
    throw std::invalid_argument(which + " carries sequence " + std::to_string(header.sequence) +
                                " (a chunk was lost or repeated)");
  }
  const std::string problem = message_header_problem(header.message, max_message_bytes);
  if (!problem.empty()) throw std::invalid_argument(which + " describes " + problem);
  if (header.length > rdma_slot_payload_bytes(slot_bytes) || header.offset > header.message.nbytes ||
      header.length > header.message.nbytes - header.offset) {
    throw std::invalid_argument(which + " claims bytes [" + std::to_string(header.offset) + ", +" +
                                std::to_string(header.length) + ") of a " + std::to_string(header.message.nbytes) +
                                "-byte message in a " + std::to_string(slot_bytes) + "-byte slot");
  }
  if (byte_len != sizeof(RdmaChunkHeader) + header.length) {
    throw std::invalid_argument(which + " arrived with " + std::to_string(byte_len) + " bytes but says it carries " +
                                std::to_string(header.length) + " after its header");
  }
  return header;
}

RdmaMessageAssembler::RdmaMessageAssembler(std::shared_ptr<BufferPool> pool, uint64_t slot_bytes,
                                           uint64_t max_message_bytes)
    : pool_(std::move(pool)), slot_bytes_(slot_bytes), max_message_bytes_(max_message_bytes) {
  (void)rdma_slot_payload_bytes(slot_bytes);
}

std::optional<Message> RdmaMessageAssembler::accept(const uint8_t* slot, size_t byte_len, uint64_t sequence) {
  const RdmaChunkHeader chunk = read_rdma_chunk(slot, byte_len, sequence, slot_bytes_, max_message_bytes_);
  if (!current_) {
    if (chunk.message_index != next_message_index_ || chunk.offset != 0) {
      throw std::invalid_argument("chunk " + std::to_string(sequence) + " continues message " +
                                  std::to_string(chunk.message_index) + " at byte " + std::to_string(chunk.offset) +
                                  " but message " + std::to_string(next_message_index_) + " starts next");
    }
    current_ = Partial{chunk.message, pool_->acquire(chunk.message.nbytes), 0};
  } else if (chunk.message_index != next_message_index_ || chunk.offset != current_->received ||
             std::memcmp(&chunk.message, &current_->header, sizeof(MessageHeader)) != 0) {
    throw std::invalid_argument("chunk " + std::to_string(sequence) + " (message " +
                                std::to_string(chunk.message_index) + ", byte " + std::to_string(chunk.offset) +
                                ") does not continue " + describe_tag(current_->header.tag) + " of message " +
                                std::to_string(next_message_index_) + " at byte " +
                                std::to_string(current_->received));
  }
  if (chunk.length > 0) {
    std::memcpy(current_->payload.data() + chunk.offset, slot + sizeof(RdmaChunkHeader), chunk.length);
  }
  current_->received += chunk.length;
  if (current_->received < current_->header.nbytes) return std::nullopt;
  Message done{current_->header, std::move(current_->payload)};
  current_.reset();
  ++next_message_index_;
  return done;
}

}  // namespace mapp
