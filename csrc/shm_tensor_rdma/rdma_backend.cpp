#include "rdma_backend.h"

#include <stdexcept>

namespace mapp {

#ifndef MAPP_HAVE_IBVERBS
RdmaStatus rdma_status() {
  return RdmaStatus{false, false, "not built (libibverbs headers were missing at build time)"};
}

std::unique_ptr<RemoteBackend> make_rdma_backend(RemoteContext, const std::string&) {
  throw std::invalid_argument("the rdma backend is not built: install libibverbs-dev and rebuild");
}
#endif

}  // namespace mapp
