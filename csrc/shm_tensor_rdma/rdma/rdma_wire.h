// What the RDMA backend's bootstrap TCP connection carries (no verbs types: always compiled, unit-tested).
// A sender connects to the receiver's local_address() and sends its endpoint info; the receiver answers with its
// own (including where its slot ring lives). After that the connection stays open as the link's lifeline: each
// end sends one control frame (bye) when it closes cleanly, and EOF without a bye means the process died.
// Fields are written little-endian one by one (not as a struct) and end with a CRC-32, so a stranger, a
// truncated read or a flipped bit is caught with a clear message instead of a QP aimed at garbage.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mapp {

constexpr uint32_t kRdmaWireMagic = 0x5244414Du;  // "MADR"
constexpr uint16_t kRdmaWireVersion = 1;
constexpr size_t kRdmaJobIdBytes = 64;

enum class RdmaRole : uint8_t { kSender = 1, kReceiver = 2 };

// One end of an RC queue-pair connection, as the other end needs to know it.
struct RdmaEndpointInfo {
  RdmaRole role = RdmaRole::kSender;
  int32_t rank = 0;
  std::string job_id;
  uint32_t qp_num = 0;    // 24 bits
  uint32_t psn = 0;       // first packet sequence number, 24 bits
  uint16_t lid = 0;       // InfiniBand local id (0 on RoCE)
  uint8_t mtu = 0;        // enum ibv_mtu (1: 256 ... 5: 4096)
  uint8_t link_layer = 0; // 1: InfiniBand, 2: Ethernet (RoCE)
  std::array<uint8_t, 16> gid{};
  // Receiver only: the registered slot ring the sender writes into. A sender announces in slot_count how many
  // slots (credit messages) its queue pair can keep in flight, and the receiver's ring uses at most that many.
  uint64_t ring_address = 0;
  uint32_t ring_rkey = 0;
  uint32_t slot_count = 0;
  uint64_t slot_bytes = 0;
};

// Encoded size of an RdmaEndpointInfo (fixed).
size_t rdma_endpoint_info_bytes();
// Throws std::invalid_argument if a field is out of range (job id too long, qp_num/psn over 24 bits, ...).
std::vector<uint8_t> encode_endpoint_info(const RdmaEndpointInfo& info);
// Throws std::invalid_argument naming what is wrong: wrong size, bad magic, other version, checksum mismatch,
// field out of range, or (for a receiver) an empty ring.
RdmaEndpointInfo decode_endpoint_info(const std::vector<uint8_t>& bytes);

// "" if `info` may connect to us: the role we expect, our job, and a rank among `expected_ranks`; else why not.
std::string check_endpoint_peer(const RdmaEndpointInfo& info, RdmaRole expected_role, const std::string& job_id,
                                const std::vector<int>& expected_ranks);

// The only frame after the exchange: a goodbye, fixed size.
enum class RdmaControlKind : uint32_t { kBye = 1 };
constexpr size_t kRdmaControlBytes = 8;
std::array<uint8_t, kRdmaControlBytes> encode_control(RdmaControlKind kind);
// Throws std::invalid_argument for a frame that is not a known control frame.
RdmaControlKind decode_control(const uint8_t* bytes, size_t size);

// CRC-32 (IEEE 802.3, as zlib.crc32) of `size` bytes.
uint32_t crc32_of(const uint8_t* data, size_t size);

}  // namespace mapp
