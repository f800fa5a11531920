// "host:port" <-> parts, for the addresses remote backends listen on and tell their peers.
#pragma once

#include <string>

namespace mapp {

struct HostPort {
  std::string host;
  int port;
};

// Throws std::invalid_argument naming the bad text. IPv6 literals go in brackets.
HostPort parse_host_port(const std::string& address);
std::string format_host_port(const std::string& host, int port);

}  // namespace mapp
