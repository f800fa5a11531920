// The RDMA backend's face to the transport. With rdma-core at build time (MAPP_HAVE_IBVERBS) it is the verbs
// backend of rdma_verbs_backend.h; without, make_rdma_backend() throws and rdma_status() says "not built".
#pragma once

#include <memory>
#include <string>

#include "backend.h"

namespace mapp {

struct RdmaStatus {
  bool built;          // compiled against libibverbs
  bool usable;         // built, and a device port the backend would use is ACTIVE here
  std::string detail;  // "not built ...", "no RDMA devices", "mlx5_0 port 1 (InfiniBand, ACTIVE)", ...
};

// Enumerates the devices now (honouring MEGATRON_APP_RDMA_DEVICE / _GID_INDEX, see rdma_settings.h).
RdmaStatus rdma_status();
// Throws std::invalid_argument ("no usable RDMA device: ...") when the backend is not built or no device is
// usable, or when an MEGATRON_APP_RDMA_* setting is bad.
std::unique_ptr<Backend> make_rdma_backend(const BackendContext& context);

}  // namespace mapp
