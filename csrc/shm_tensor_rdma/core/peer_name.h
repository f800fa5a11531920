// How every error names a peer, whatever backend reaches it: "peer rank 3", or "peer rank 3 (10.0.0.2:41234)"
// once a remote peer's address is known. The one place that spells it (tests/test_cpp_structure.py checks).
#pragma once

#include <optional>
#include <string>

#include "host_port.h"

namespace mapp {

std::string peer_name(int peer);
std::string peer_name(int peer, const std::optional<HostPort>& address);

}  // namespace mapp
