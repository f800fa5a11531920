// Settings of one rank's transport, and their validation (std::invalid_argument with a clear message).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mapp {

struct TransportOptions {
  int rank = 0;
  int world_size = 1;
  std::string job_id;
  // The job's secret (drawn by rank 0, shared through the store); connections that cannot prove it are dropped.
  // Empty only where every rank gives it empty (tests in one process): then the job id alone admits.
  std::string admission_secret;
  uint64_t slot_bytes = uint64_t{1} << 20;
  // 16 x 1 MiB: the slots a stream cycles through stay in cache. With 64 (a 64 MiB ring) each chunk copy ran at
  // about half the speed (7 vs 13 GB/s per 1 MiB chunk on the test machine); the drain thread empties slots as
  // they fill, so a small ring does not limit how many messages are in flight.
  uint32_t num_slots = 16;
  uint64_t max_message_bytes = uint64_t{1} << 30;
  int send_workers = 2;
  std::optional<std::vector<int>> peers;  // default: every other rank
  double timeout_s = 300.0;
  // Backend per peer, a name from backend_registry.h: "shm" (default for peers not named), "tcp" or "rdma". The
  // caller decides (it knows hosts).
  std::map<int, std::string> peer_backends;
  std::string listen_host = "127.0.0.1";  // where remote backends listen, and the address peers are told
  int listen_port = 0;                     // 0: any free port
};

// Names accepted in peer_backends.
bool is_backend_name(const std::string& name);

// Returns the options unchanged, or throws std::invalid_argument naming the bad setting.
TransportOptions validate_options(TransportOptions options);
// The sorted peer ranks: options.peers checked, or every other rank by default.
std::vector<int> resolve_peers(const TransportOptions& options);

}  // namespace mapp
