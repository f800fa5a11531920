#include "tcp_frame.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

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
  if (their_job != job_id) return "rank " + std::to_string(hello.rank) + " belongs to job '" + their_job + "'";
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
  if (frame.message.ndim > kMaxDims) return "frame with " + std::to_string(frame.message.ndim) + " dimensions";
  if (frame.message.nbytes > max_message_bytes) {
    return "frame of " + std::to_string(frame.message.nbytes) + " bytes exceeds max_message_bytes=" +
           std::to_string(max_message_bytes);
  }
  return "";
}

HostPort parse_host_port(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw std::invalid_argument("address '" + address + "' is not host:port");
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port_text = address.substr(colon + 1);
  if (port_text.find_first_not_of("0123456789") != std::string::npos || port_text.size() > 5) {
    throw std::invalid_argument("address '" + address + "' has a bad port");
  }
  const int port = std::stoi(port_text);
  if (port < 1 || port > 65535) throw std::invalid_argument("address '" + address + "' has a port out of range");
  return HostPort{host, port};
}

std::string format_host_port(const std::string& host, int port) {
  const bool ipv6 = host.find(':') != std::string::npos;
  return (ipv6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string describe_remote_peer(int peer, const std::optional<HostPort>& address) {
  const std::string name = "peer rank " + std::to_string(peer);
  return address ? name + " (" + format_host_port(address->host, address->port) + ")" : name;
}

}  // namespace mapp
