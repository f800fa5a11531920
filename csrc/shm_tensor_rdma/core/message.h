// What travels with every message: its tag, a dtype code (meaning defined by the Python side), the shape and the
// payload size. Each chunk in a shared-memory slot carries the full header plus its byte range, so the receiver
// can assemble messages without any other state from the sender.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace mapp {

constexpr uint32_t kMaxDims = 32;

struct MessageHeader {
  uint64_t tag;
  uint64_t nbytes;
  uint32_t dtype_code;
  uint32_t ndim;
  int64_t shape[kMaxDims];
};

struct ChunkHeader {
  MessageHeader message;
  uint64_t offset;  // where this chunk's bytes go in the message
  uint64_t length;  // bytes of payload in this chunk's slot
};

// Throws std::invalid_argument for too many dimensions or a negative extent.
MessageHeader make_message_header(uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                                  uint64_t nbytes);
std::vector<int64_t> shape_of(const MessageHeader& header);
// "" if a received header is one a sender could have made (dimensions, extents) and fits max_message_bytes, else
// why not. Every backend checks what another process wrote before it allocates or copies by it.
std::string message_header_problem(const MessageHeader& header, uint64_t max_message_bytes);

// (peer rank, tag): how callers name a message.
using MessageKey = std::pair<int, uint64_t>;

struct MessageKeyHash {
  size_t operator()(const MessageKey& key) const noexcept {
    return std::hash<uint64_t>()(key.second * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(key.first));
  }
};

}  // namespace mapp
