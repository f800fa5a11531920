// What the RDMA backend is told (environment, NCCL style) and how it picks a port and a GID from what the device
// reports. No verbs types: always compiled, unit-tested; rdma_device.cpp feeds it the device's answers.
//   MEGATRON_APP_RDMA_DEVICE     "mlx5_0" or "mlx5_0:1" (default: the first ACTIVE port of any device)
//   MEGATRON_APP_RDMA_GID_INDEX  GID table index (default: RoCE v2 with an IPv4 address, else v2, else v1)
//   MEGATRON_APP_RDMA_SLOT_BYTES bytes per receive slot, chunk header included (default 1 MiB)
//   MEGATRON_APP_RDMA_SLOTS      slots per inbound link (default 16)
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace mapp {

struct RdmaSettings {
  std::string device;    // "" = any
  int port = 0;          // 0 = any
  int gid_index = -1;    // -1 = choose
  uint64_t slot_bytes = uint64_t{1} << 20;
  uint32_t slot_count = 16;
};

// `lookup(name)` returns the variable's value or nullptr (std::getenv in production). Throws
// std::invalid_argument naming the variable and its bad value.
RdmaSettings parse_rdma_settings(const std::function<const char*(const char*)>& lookup);
RdmaSettings rdma_settings_from_environment();

constexpr uint8_t kLinkLayerInfiniband = 1;
constexpr uint8_t kLinkLayerEthernet = 2;
enum class GidType : uint32_t { kInfiniband = 0, kRoceV1 = 1, kRoceV2 = 2 };  // enum ibv_gid_type's values

struct RdmaGidEntry {
  uint32_t index;
  GidType type;
  std::array<uint8_t, 16> gid;
};

struct RdmaPortSummary {
  std::string device;
  int port;
  bool active;
  uint8_t link_layer;
  std::vector<RdmaGidEntry> gids;
};

// "mlx5_0 port 1 (InfiniBand, ACTIVE)"
std::string describe_port(const RdmaPortSummary& port);

// The GID index to use on `port`: the requested one (it must exist), none needed on InfiniBand (returns -1: the
// LID routes), else on Ethernet a RoCE v2 GID holding an IPv4-mapped address, then any RoCE v2, then RoCE v1.
// Throws std::invalid_argument when the port has no usable GID.
int choose_gid_index(const RdmaPortSummary& port, int requested);

// The port to use: the first ACTIVE one that matches settings.device/port and has a usable GID. Throws
// std::invalid_argument saying why none qualifies ("no RDMA devices", "mlx5_3 not found (devices: ...)", ...).
const RdmaPortSummary& choose_rdma_port(const std::vector<RdmaPortSummary>& ports, const RdmaSettings& settings);

}  // namespace mapp
