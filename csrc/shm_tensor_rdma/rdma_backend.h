// The RDMA backend's face to the transport. Compiled with libibverbs when <infiniband/verbs.h> was found at build
// time (MAPP_HAVE_IBVERBS); otherwise make_rdma_backend() throws and rdma_status() says "not built".
#pragma once

#include <memory>
#include <string>

#include "remote_backend.h"

namespace mapp {

struct RdmaStatus {
  bool built;          // compiled against libibverbs
  bool usable;         // built, and a device with an active port exists here
  std::string detail;  // "not built", "no RDMA devices", "mlx5_0 port 1 ACTIVE", ...
};

RdmaStatus rdma_status();
// Throws std::invalid_argument when the backend is not built or no device is usable.
std::unique_ptr<RemoteBackend> make_rdma_backend(RemoteContext context, const std::string& listen_host);

}  // namespace mapp
