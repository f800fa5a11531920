#include "backend_registry.h"

#include "rdma_backend.h"
#include "shm_backend.h"
#include "shm_names.h"
#include "tcp_backend.h"

namespace mapp {
namespace {

std::unique_ptr<Backend> make_shm_backend(const BackendContext& context) {
  return std::make_unique<ShmBackend>(context);
}

std::unique_ptr<Backend> make_tcp_backend(const BackendContext& context) {
  return std::make_unique<TcpBackend>(context);
}

}  // namespace

const std::array<BackendKind, kBackendKinds>& backend_kinds() {
  static const std::array<BackendKind, kBackendKinds> kinds{{
      {"shm", "shared-memory rings between processes of one host", /*remote=*/false, /*needs_device=*/false,
       /*auto_priority=*/30, make_shm_backend, remove_dead_job_segments},
      {"tcp", "TCP sockets between hosts", /*remote=*/true, /*needs_device=*/false, /*auto_priority=*/10,
       make_tcp_backend, nullptr},
      {"rdma", "RDMA (ibverbs) between hosts with a usable device", /*remote=*/true, /*needs_device=*/true,
       /*auto_priority=*/20, make_rdma_backend, nullptr},
  }};
  return kinds;
}

const char* default_backend_name() { return backend_kinds()[0].name; }

const BackendKind* find_backend_kind(const std::string& name) {
  for (const BackendKind& kind : backend_kinds()) {
    if (name == kind.name) return &kind;
  }
  return nullptr;
}

std::vector<std::string> remove_dead_job_leftovers(const std::string& job_id) {
  std::vector<std::string> removed;
  for (const BackendKind& kind : backend_kinds()) {
    if (!kind.remove_dead_leftovers) continue;
    for (std::string& name : kind.remove_dead_leftovers(job_id)) removed.push_back(std::move(name));
  }
  return removed;
}

std::string backend_name_list() {
  std::string text;
  for (size_t i = 0; i < kBackendKinds; ++i) {
    text += (i == 0 ? "" : i + 1 == kBackendKinds ? " or " : ", ") + std::string(backend_kinds()[i].name);
  }
  return text;
}

}  // namespace mapp
