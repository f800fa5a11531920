// What travels on a TCP link. A connection carries one direction (sender -> receiver): first a hello naming the
// sender, then frames. A data frame is the same MessageHeader the shm backend uses, followed by nbytes of payload;
// a bye frame says the sender closed cleanly. Both ends run the same build, so structs go as they are in memory
// (no byte swapping: mixed-endian clusters are not supported; the magic catches a stranger).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "message.h"

namespace mapp {

constexpr uint32_t kTcpMagic = 0x5450414Du;  // "MAPT"
constexpr uint32_t kTcpVersion = 1;
constexpr size_t kTcpJobIdBytes = 64;

enum class TcpFrameKind : uint32_t { kData = 1, kBye = 2 };

struct TcpHello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  uint32_t reserved;
  char job_id[kTcpJobIdBytes];  // NUL-padded
};

struct TcpFrameHeader {
  uint32_t magic;
  uint32_t kind;  // TcpFrameKind
  MessageHeader message;
};

// Throws std::invalid_argument if the job id does not fit.
TcpHello make_tcp_hello(int rank, const std::string& job_id);
// "" if a receiver of `job_id` serving `expected_peers` accepts this hello, else why not.
std::string check_tcp_hello(const TcpHello& hello, const std::string& job_id, const std::vector<int>& expected_peers);
TcpFrameHeader make_tcp_data_frame(const MessageHeader& message);
TcpFrameHeader make_tcp_bye_frame();
// "" if the frame is well formed and its payload fits max_message_bytes, else why not.
std::string check_tcp_frame(const TcpFrameHeader& frame, uint64_t max_message_bytes);

}  // namespace mapp
