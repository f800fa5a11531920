#include "peer_name.h"

namespace mapp {

std::string peer_name(int peer) { return "peer rank " + std::to_string(peer); }

std::string peer_name(int peer, const std::optional<HostPort>& address) {
  return address ? peer_name(peer) + " (" + format_host_port(address->host, address->port) + ")" : peer_name(peer);
}

}  // namespace mapp
