#include "host_port.h"

#include <stdexcept>

namespace mapp {

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

}  // namespace mapp
