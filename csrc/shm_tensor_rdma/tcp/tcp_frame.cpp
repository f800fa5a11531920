#include "tcp_frame.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace mapp {

TcpHello make_tcp_hello(int rank, const std::string& job_id) {
  if (job_id.size() >= kTcpJobIdBytes) {
    throw std::invalid_argument("job id '" + job_id + "' is longer than " + std::to_string(kTcpJobIdBytes - 1) +
                                " characters");
  }
  TcpHello hello;
  std::memset(&hello, 0, sizeof(hello));
  hello.magic = kTcpMagic;
  hello.version = kTcpVersion;
  hello.rank = rank;
  std::memcpy(hello.job_id, job_id.data(), job_id.size());
  return hello;
}

std::string check_tcp_hello(const TcpHello& hello, const std::string& job_id, const std::vector<int>& expected_peers) {
  if (hello.magic != kTcpMagic) return "not a megatron_app transport connection (bad magic)";
  if (hello.version != kTcpVersion) {
    return "protocol version " + std::to_string(hello.version) + " != ours (" + std::to_string(kTcpVersion) + ")";
  }
  const std::string their_job(hello.job_id, strnlen(hello.job_id, kTcpJobIdBytes));
  if (their_job != job_id) return "rank " + std::to_string(hello.rank) + " belongs to job '" + printable_text(their_job) + "'";
  if (std::find(expected_peers.begin(), expected_peers.end(), hello.rank) == expected_peers.end()) {
    return "rank " + std::to_string(hello.rank) + " is not a tcp peer of this rank";
  }
  return "";
}

TcpFrameHeader make_tcp_data_frame(const MessageHeader& message) {
  TcpFrameHeader frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.magic = kTcpMagic;
  frame.kind = static_cast<uint32_t>(TcpFrameKind::kData);
  frame.message = message;
  return frame;
}

TcpFrameHeader make_tcp_bye_frame() {
  TcpFrameHeader frame;
  std::memset(&frame, 0, sizeof(frame));
  frame.magic = kTcpMagic;
  frame.kind = static_cast<uint32_t>(TcpFrameKind::kBye);
  return frame;
}

std::string check_tcp_frame(const TcpFrameHeader& frame, uint64_t max_message_bytes) {
  if (frame.magic != kTcpMagic) return "corrupt stream (bad frame magic)";
  if (frame.kind == static_cast<uint32_t>(TcpFrameKind::kBye)) return "";
  if (frame.kind != static_cast<uint32_t>(TcpFrameKind::kData)) {
    return "unknown frame kind " + std::to_string(frame.kind);
  }
  const std::string problem = message_header_problem(frame.message, max_message_bytes);
  if (!problem.empty()) return "frame describing " + problem;
  return "";
}

}  // namespace mapp
