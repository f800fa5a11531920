#include "rdma_backend.h"

#include <stdexcept>

#include "rdma_settings.h"

#ifdef MAPP_HAVE_IBVERBS
#include "rdma_device.h"
#include "rdma_verbs_backend.h"
#endif

namespace mapp {

#ifdef MAPP_HAVE_IBVERBS

RdmaStatus rdma_status() {
  try {
    const RdmaSettings settings = rdma_settings_from_environment();
    const std::vector<RdmaPortSummary> ports = list_rdma_ports();
    const RdmaPortSummary& port = choose_rdma_port(ports, settings);
    const int gid_index = choose_gid_index(port, settings.gid_index);
    return RdmaStatus{true, true, describe_port(port) + (gid_index >= 0 ? " GID index " + std::to_string(gid_index) : "")};
  } catch (const std::exception& error) {
    return RdmaStatus{true, false, error.what()};
  }
}

std::unique_ptr<Backend> make_rdma_backend(const BackendContext& context) {
  RdmaSettings settings;
  try {
    settings = rdma_settings_from_environment();
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("no usable RDMA device: ") + error.what());
  }
  return std::make_unique<RdmaBackend>(context, settings);
}

#else

RdmaStatus rdma_status() {
  return RdmaStatus{false, false, "not built (libibverbs headers were missing at build time)"};
}

std::unique_ptr<Backend> make_rdma_backend(const BackendContext&) {
  throw std::invalid_argument("no usable RDMA device: the rdma backend is not built (install libibverbs-dev and "
                              "rebuild)");
}

#endif

}  // namespace mapp
