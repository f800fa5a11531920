#include "rdma_wire.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace mapp {
namespace {

constexpr uint32_t kMax24Bits = (1u << 24) - 1;

// Appends fixed-width little-endian fields.
class WireWriter {
 public:
  void u8(uint8_t value) { bytes_.push_back(value); }
  void u16(uint16_t value) { little_endian(value, 2); }
  void u32(uint32_t value) { little_endian(value, 4); }
  void u64(uint64_t value) { little_endian(value, 8); }
  void raw(const uint8_t* data, size_t size) { bytes_.insert(bytes_.end(), data, data + size); }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  void little_endian(uint64_t value, int width) {
    for (int i = 0; i < width; ++i) bytes_.push_back(static_cast<uint8_t>(value >> (8 * i)));
  }
  std::vector<uint8_t> bytes_;
};

// Reads what WireWriter wrote; the caller checked the total size first.
class WireReader {
 public:
  explicit WireReader(const uint8_t* data) : data_(data) {}
  uint8_t u8() { return data_[at_++]; }
  uint16_t u16() { return static_cast<uint16_t>(little_endian(2)); }
  uint32_t u32() { return static_cast<uint32_t>(little_endian(4)); }
  uint64_t u64() { return little_endian(8); }
  void raw(uint8_t* out, size_t size) {
    std::memcpy(out, data_ + at_, size);
    at_ += size;
  }

 private:
  uint64_t little_endian(int width) {
    uint64_t value = 0;
    for (int i = 0; i < width; ++i) value |= static_cast<uint64_t>(data_[at_++]) << (8 * i);
    return value;
  }
  const uint8_t* data_;
  size_t at_ = 0;
};

void check_ranges(const RdmaEndpointInfo& info) {
  if (info.role != RdmaRole::kSender && info.role != RdmaRole::kReceiver) {
    throw std::invalid_argument("unknown endpoint role " + std::to_string(static_cast<int>(info.role)));
  }
  if (info.job_id.size() >= kRdmaJobIdBytes) {
    throw std::invalid_argument("job id '" + info.job_id + "' is longer than " +
                                std::to_string(kRdmaJobIdBytes - 1) + " characters");
  }
  if (info.qp_num > kMax24Bits) throw std::invalid_argument("qp_num " + std::to_string(info.qp_num) + " over 24 bits");
  if (info.psn > kMax24Bits) throw std::invalid_argument("psn " + std::to_string(info.psn) + " over 24 bits");
  if (info.mtu < 1 || info.mtu > 5) throw std::invalid_argument("path mtu code " + std::to_string(info.mtu) + " not in 1..5");
  if (info.link_layer != 1 && info.link_layer != 2) {
    throw std::invalid_argument("link layer code " + std::to_string(info.link_layer) + " is neither 1 (InfiniBand) nor 2 (Ethernet)");
  }
  if (info.slot_count == 0) throw std::invalid_argument("slot count is 0");
  if (info.role == RdmaRole::kReceiver) {
    if (info.ring_address == 0 || info.slot_bytes == 0) throw std::invalid_argument("receiver announced no slot ring");
  }
}

const uint32_t* crc_table() {
  static const auto table = [] {
    std::array<uint32_t, 256> entries{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      entries[n] = c;
    }
    return entries;
  }();
  return table.data();
}

}  // namespace

uint32_t crc32_of(const uint8_t* data, size_t size) {
  const uint32_t* table = crc_table();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

std::vector<uint8_t> encode_endpoint_info(const RdmaEndpointInfo& info) {
  check_ranges(info);
  WireWriter out;
  out.u32(kRdmaWireMagic);
  out.u16(kRdmaWireVersion);
  out.u8(static_cast<uint8_t>(info.role));
  out.u8(info.link_layer);
  out.u32(static_cast<uint32_t>(info.rank));
  uint8_t job[kRdmaJobIdBytes] = {0};
  std::memcpy(job, info.job_id.data(), info.job_id.size());
  out.raw(job, sizeof(job));
  out.u32(info.qp_num);
  out.u32(info.psn);
  out.u16(info.lid);
  out.u8(info.mtu);
  out.u8(0);  // reserved
  out.raw(info.gid.data(), info.gid.size());
  out.u64(info.ring_address);
  out.u32(info.ring_rkey);
  out.u32(info.slot_count);
  out.u64(info.slot_bytes);
  std::vector<uint8_t>& bytes = out.bytes();
  out.u32(crc32_of(bytes.data(), bytes.size()));
  return bytes;
}

size_t rdma_endpoint_info_bytes() {
  static const size_t size = [] {
    RdmaEndpointInfo sample;
    sample.mtu = 1;
    sample.link_layer = 1;
    sample.slot_count = 1;
    return encode_endpoint_info(sample).size();
  }();
  return size;
}

RdmaEndpointInfo decode_endpoint_info(const std::vector<uint8_t>& bytes) {
  const size_t expected = rdma_endpoint_info_bytes();
  if (bytes.size() != expected) {
    throw std::invalid_argument("endpoint info of " + std::to_string(bytes.size()) + " bytes, expected " +
                                std::to_string(expected));
  }
  WireReader in(bytes.data());
  if (in.u32() != kRdmaWireMagic) throw std::invalid_argument("not a megatron_app rdma endpoint (bad magic)");
  const uint16_t version = in.u16();
  if (version != kRdmaWireVersion) {
    throw std::invalid_argument("rdma protocol version " + std::to_string(version) + " != ours (" +
                                std::to_string(kRdmaWireVersion) + ")");
  }
  if (WireReader(bytes.data() + expected - 4).u32() != crc32_of(bytes.data(), expected - 4)) {
    throw std::invalid_argument("endpoint info checksum mismatch (corrupted in transit)");
  }
  RdmaEndpointInfo info;
  info.role = static_cast<RdmaRole>(in.u8());
  info.link_layer = in.u8();
  info.rank = static_cast<int32_t>(in.u32());
  char job[kRdmaJobIdBytes];
  in.raw(reinterpret_cast<uint8_t*>(job), sizeof(job));
  info.job_id.assign(job, strnlen(job, sizeof(job)));
  if (info.job_id.size() == sizeof(job)) throw std::invalid_argument("job id is not NUL-terminated");
  if (printable_text(info.job_id) != info.job_id) {
    throw std::invalid_argument("job id '" + printable_text(info.job_id) + "' is not printable ASCII");
  }
  info.qp_num = in.u32();
  info.psn = in.u32();
  info.lid = in.u16();
  info.mtu = in.u8();
  (void)in.u8();
  in.raw(info.gid.data(), info.gid.size());
  info.ring_address = in.u64();
  info.ring_rkey = in.u32();
  info.slot_count = in.u32();
  info.slot_bytes = in.u64();
  check_ranges(info);
  return info;
}

std::string check_endpoint_peer(const RdmaEndpointInfo& info, RdmaRole expected_role, const std::string& job_id,
                                const std::vector<int>& expected_ranks) {
  if (info.job_id != job_id) return "rank " + std::to_string(info.rank) + " belongs to job '" + info.job_id + "'";
  if (info.role != expected_role) {
    return "rank " + std::to_string(info.rank) + " connected as a " +
           (info.role == RdmaRole::kSender ? "sender" : "receiver") + " where a " +
           (expected_role == RdmaRole::kSender ? "sender" : "receiver") + " was expected";
  }
  if (std::find(expected_ranks.begin(), expected_ranks.end(), info.rank) == expected_ranks.end()) {
    return "rank " + std::to_string(info.rank) + " is not an rdma peer of this rank";
  }
  return "";
}

std::array<uint8_t, kRdmaControlBytes> encode_control(RdmaControlKind kind) {
  std::array<uint8_t, kRdmaControlBytes> bytes{};
  const uint32_t words[2] = {kRdmaWireMagic, static_cast<uint32_t>(kind)};
  for (int w = 0; w < 2; ++w) {
    for (int i = 0; i < 4; ++i) bytes[4 * w + i] = static_cast<uint8_t>(words[w] >> (8 * i));
  }
  return bytes;
}

RdmaControlKind decode_control(const uint8_t* bytes, size_t size) {
  if (size != kRdmaControlBytes) {
    throw std::invalid_argument("control frame of " + std::to_string(size) + " bytes, expected " +
                                std::to_string(kRdmaControlBytes));
  }
  WireReader in(bytes);
  if (in.u32() != kRdmaWireMagic) throw std::invalid_argument("corrupt control frame (bad magic)");
  const uint32_t kind = in.u32();
  if (kind != static_cast<uint32_t>(RdmaControlKind::kBye)) {
    throw std::invalid_argument("unknown control frame kind " + std::to_string(kind));
  }
  return RdmaControlKind::kBye;
}

}  // namespace mapp
