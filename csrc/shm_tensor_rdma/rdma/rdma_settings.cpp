#include "rdma_settings.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "rdma_chunk.h"

namespace mapp {
namespace {

constexpr uint64_t kMaxSlotBytes = uint64_t{1} << 30;
constexpr uint32_t kMaxSlots = 4096;

uint64_t parse_unsigned(const char* name, const std::string& text, uint64_t low, uint64_t high) {
  const bool digits = !text.empty() && text.size() <= 19 && text.find_first_not_of("0123456789") == std::string::npos;
  const uint64_t value = digits ? std::stoull(text) : 0;
  if (!digits || value < low || value > high) {
    throw std::invalid_argument(std::string(name) + "='" + text + "' must be a whole number from " +
                                std::to_string(low) + " to " + std::to_string(high));
  }
  return value;
}

bool is_ipv4_mapped(const std::array<uint8_t, 16>& gid) {
  for (int i = 0; i < 10; ++i) {
    if (gid[i] != 0) return false;
  }
  return gid[10] == 0xFF && gid[11] == 0xFF;
}

bool is_zero(const std::array<uint8_t, 16>& gid) {
  for (uint8_t byte : gid) {
    if (byte != 0) return false;
  }
  return true;
}

}  // namespace

RdmaSettings parse_rdma_settings(const std::function<const char*(const char*)>& lookup) {
  RdmaSettings settings;
  if (const char* device = lookup("MEGATRON_APP_RDMA_DEVICE"); device && *device) {
    std::string text = device;
    const size_t colon = text.rfind(':');
    if (colon != std::string::npos) {
      settings.port = static_cast<int>(parse_unsigned("MEGATRON_APP_RDMA_DEVICE's port", text.substr(colon + 1), 1, 255));
      text = text.substr(0, colon);
    }
    if (text.empty()) throw std::invalid_argument("MEGATRON_APP_RDMA_DEVICE='" + std::string(device) + "' names no device");
    settings.device = text;
  }
  if (const char* index = lookup("MEGATRON_APP_RDMA_GID_INDEX"); index && *index) {
    settings.gid_index = static_cast<int>(parse_unsigned("MEGATRON_APP_RDMA_GID_INDEX", index, 0, 65535));
  }
  if (const char* bytes = lookup("MEGATRON_APP_RDMA_SLOT_BYTES"); bytes && *bytes) {
    settings.slot_bytes = parse_unsigned("MEGATRON_APP_RDMA_SLOT_BYTES", bytes, 4096, kMaxSlotBytes);
  }
  if (const char* slots = lookup("MEGATRON_APP_RDMA_SLOTS"); slots && *slots) {
    settings.slot_count = static_cast<uint32_t>(parse_unsigned("MEGATRON_APP_RDMA_SLOTS", slots, 2, kMaxSlots));
  }
  (void)rdma_slot_payload_bytes(settings.slot_bytes);
  return settings;
}

RdmaSettings rdma_settings_from_environment() {
  return parse_rdma_settings([](const char* name) { return std::getenv(name); });
}

std::string describe_port(const RdmaPortSummary& port) {
  return port.device + " port " + std::to_string(port.port) + " (" +
         (port.link_layer == kLinkLayerEthernet ? "Ethernet/RoCE" : "InfiniBand") + ", " +
         (port.active ? "ACTIVE" : "not active") + ")";
}

int choose_gid_index(const RdmaPortSummary& port, int requested) {
  if (requested >= 0) {
    for (const RdmaGidEntry& entry : port.gids) {
      if (static_cast<int>(entry.index) == requested && !is_zero(entry.gid)) return requested;
    }
    throw std::invalid_argument("MEGATRON_APP_RDMA_GID_INDEX=" + std::to_string(requested) + " is not a valid GID of " +
                                describe_port(port));
  }
  if (port.link_layer != kLinkLayerEthernet) return -1;
  const RdmaGidEntry* best = nullptr;
  auto rank_of = [](const RdmaGidEntry& entry) {
    if (entry.type == GidType::kRoceV2) return is_ipv4_mapped(entry.gid) ? 3 : 2;
    return entry.type == GidType::kRoceV1 ? 1 : 0;
  };
  for (const RdmaGidEntry& entry : port.gids) {
    if (is_zero(entry.gid) || rank_of(entry) == 0) continue;
    if (best == nullptr || rank_of(entry) > rank_of(*best)) best = &entry;
  }
  if (best == nullptr) {
    throw std::invalid_argument(describe_port(port) + " has no RoCE GID (is an IP address set on its netdev?)");
  }
  return static_cast<int>(best->index);
}

const RdmaPortSummary& choose_rdma_port(const std::vector<RdmaPortSummary>& ports, const RdmaSettings& settings) {
  if (ports.empty()) throw std::invalid_argument("no RDMA devices");
  std::vector<std::string> devices;
  std::string problems;
  bool device_seen = settings.device.empty();
  for (const RdmaPortSummary& port : ports) {
    if (std::find(devices.begin(), devices.end(), port.device) == devices.end()) devices.push_back(port.device);
    if (!settings.device.empty() && port.device != settings.device) continue;
    device_seen = true;
    if (settings.port != 0 && port.port != settings.port) continue;
    if (!port.active) {
      problems += (problems.empty() ? "" : "; ") + describe_port(port);
      continue;
    }
    try {
      (void)choose_gid_index(port, settings.gid_index);
      return port;
    } catch (const std::invalid_argument& error) {
      problems += (problems.empty() ? "" : "; ") + std::string(error.what());
    }
  }
  if (!device_seen) {
    std::string names;
    for (const std::string& name : devices) names += (names.empty() ? "" : ", ") + name;
    throw std::invalid_argument("MEGATRON_APP_RDMA_DEVICE=" + settings.device + " not found (devices: " + names + ")");
  }
  if (problems.empty()) {
    throw std::invalid_argument(settings.device + " has no port " + std::to_string(settings.port));
  }
  throw std::invalid_argument("no usable RDMA port: " + problems);
}

}  // namespace mapp
