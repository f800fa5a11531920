#include "transport_options.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "backend_registry.h"
#include "shm_names.h"

namespace mapp {
namespace {

constexpr uint64_t kPageBytes = 4096;
constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;
constexpr uint32_t kMaxSlots = 1u << 20;
constexpr int kMaxSendWorkers = 64;

}  // namespace

TransportOptions validate_options(TransportOptions options) {
  validate_job_id(options.job_id);
  if (options.world_size < 1) {
    throw std::invalid_argument("world_size must be >= 1, got " + std::to_string(options.world_size));
  }
  if (options.rank < 0 || options.rank >= options.world_size) {
    throw std::invalid_argument("rank " + std::to_string(options.rank) + " is out of range for world_size " +
                                std::to_string(options.world_size));
  }
  if (options.slot_bytes < kPageBytes || options.slot_bytes > kMaxSlotBytes || options.slot_bytes % kPageBytes) {
    throw std::invalid_argument("slot_bytes must be a multiple of 4096 between 4096 and 2**30, got " +
                                std::to_string(options.slot_bytes));
  }
  if (options.num_slots < 2 || options.num_slots > kMaxSlots) {
    throw std::invalid_argument("num_slots must be between 2 and 2**20, got " + std::to_string(options.num_slots));
  }
  if (options.max_message_bytes < 1) throw std::invalid_argument("max_message_bytes must be >= 1");
  if (options.send_workers < 1 || options.send_workers > kMaxSendWorkers) {
    throw std::invalid_argument("send_workers must be between 1 and 64, got " +
                                std::to_string(options.send_workers));
  }
  if (!(options.timeout_s > 0) || !std::isfinite(options.timeout_s)) {
    throw std::invalid_argument("timeout_s must be a positive number of seconds, got " +
                                std::to_string(options.timeout_s));
  }
  for (const auto& [peer, backend] : options.peer_backends) {
    if (!is_backend_name(backend)) {
      throw std::invalid_argument("unknown backend '" + backend + "' for peer " + std::to_string(peer) +
                                  "; choose " + backend_name_list());
    }
  }
  if (options.listen_port < 0 || options.listen_port > 65535) {
    throw std::invalid_argument("listen_port must be between 0 and 65535, got " + std::to_string(options.listen_port));
  }
  return options;
}

bool is_backend_name(const std::string& name) { return find_backend_kind(name) != nullptr; }

std::vector<int> resolve_peers(const TransportOptions& options) {
  std::vector<int> peers;
  if (!options.peers) {
    for (int rank = 0; rank < options.world_size; ++rank) {
      if (rank != options.rank) peers.push_back(rank);
    }
    return peers;
  }
  peers = *options.peers;
  std::sort(peers.begin(), peers.end());
  for (size_t i = 0; i < peers.size(); ++i) {
    const int peer = peers[i];
    if (peer < 0 || peer >= options.world_size) {
      throw std::invalid_argument("peer " + std::to_string(peer) + " is out of range for world_size " +
                                  std::to_string(options.world_size));
    }
    if (peer == options.rank) throw std::invalid_argument("rank " + std::to_string(peer) + " cannot be its own peer");
    if (i > 0 && peers[i - 1] == peer) throw std::invalid_argument("peer " + std::to_string(peer) + " listed twice");
  }
  return peers;
}

}  // namespace mapp
