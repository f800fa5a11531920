// Every transport backend, by name: the one list the transport (factory), option validation and the Python
// module (BACKEND_KINDS: name, summary, reach and automatic-choice priority) read. Adding a backend is one Backend subclass plus one line in backend_registry.cpp.
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "backend.h"

namespace mapp {

struct BackendKind {
  const char* name;
  const char* summary;
  // Carries links between hosts (needs an address exchange at start-up); false: same host only.
  bool remote;
  // Serves a link only where both ends have a usable device (rdma).
  bool needs_device;
  // The automatic choice takes, per link, the usable backend with the highest priority.
  int auto_priority;
  // Throws std::invalid_argument when the backend cannot serve here (rdma without a device), std::runtime_error
  // when a resource cannot be had.
  std::unique_ptr<Backend> (*create)(const BackendContext& context);
  // Removes what dead processes of `job_id` left behind (shm: segment names); returns what it removed. nullptr:
  // the backend leaves nothing behind a process.
  std::vector<std::string> (*remove_dead_leftovers)(const std::string& job_id);
};

constexpr size_t kBackendKinds = 3;

// In the order a transport creates them. A backend with its own arrivals doorbell (shm) comes first, so the
// backends made after it ring that doorbell.
const std::array<BackendKind, kBackendKinds>& backend_kinds();
// The backend of peers the caller names none for ("shm").
const char* default_backend_name();
// nullptr for an unknown name.
const BackendKind* find_backend_kind(const std::string& name);
// Every backend's remove_dead_leftovers for `job_id`, in registry order.
std::vector<std::string> remove_dead_job_leftovers(const std::string& job_id);
// "shm, tcp or rdma", for error messages.
std::string backend_name_list();

}  // namespace mapp
