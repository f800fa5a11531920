#include "loss_fill.h"

#include <cstring>
#include <stdexcept>

namespace mapp {
namespace {

template <typename T>
void scale_as(uint8_t* data, uint64_t count, double factor) {
  const T scale = static_cast<T>(factor);
  for (uint64_t i = 0; i < count; ++i) {
    T value;
    std::memcpy(&value, data + i * sizeof(T), sizeof(T));  // payloads need not be aligned to T
    value = static_cast<T>(value * scale);
    std::memcpy(data + i * sizeof(T), &value, sizeof(T));
  }
}

// bfloat16 is the top half of a float32; round to nearest even on the way back, keeping NaNs quiet NaNs.
void scale_bfloat16(uint8_t* data, uint64_t count, double factor) {
  const float scale = static_cast<float>(factor);
  for (uint64_t i = 0; i < count; ++i) {
    uint16_t half;
    std::memcpy(&half, data + i * 2, 2);
    uint32_t bits = static_cast<uint32_t>(half) << 16;
    float value;
    std::memcpy(&value, &bits, 4);
    value *= scale;
    std::memcpy(&bits, &value, 4);
    if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
      half = static_cast<uint16_t>((bits >> 16) | 0x0040u);
    } else {
      half = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
    std::memcpy(data + i * 2, &half, 2);
  }
}

}  // namespace

void widen_to_elements(std::vector<ByteRange>& ranges, uint64_t element_size, uint64_t nbytes) {
  for (ByteRange& range : ranges) {
    if (element_size > 1) {
      range.begin -= range.begin % element_size;
      range.end += (element_size - range.end % element_size) % element_size;
    }
    if (range.end > nbytes) range.end = nbytes;
  }
}

void zero_ranges(uint8_t* data, const std::vector<ByteRange>& ranges) {
  for (const ByteRange& range : ranges) std::memset(data + range.begin, 0, range.end - range.begin);
}

void restore_ranges(uint8_t* data, const std::vector<ByteRange>& ranges, const uint8_t* previous) {
  for (const ByteRange& range : ranges) {
    std::memcpy(data + range.begin, previous + range.begin, range.end - range.begin);
  }
}

void scale_elements(uint8_t* data, uint64_t nbytes, ElementType type, double factor) {
  if (factor == 1.0) return;
  switch (type.kind) {
    case ElementKind::kFloat32:
      scale_as<float>(data, nbytes / 4, factor);
      return;
    case ElementKind::kFloat64:
      scale_as<double>(data, nbytes / 8, factor);
      return;
    case ElementKind::kBFloat16:
      scale_bfloat16(data, nbytes / 2, factor);
      return;
    case ElementKind::kFloat16:
#ifdef __FLT16_MAX__
      scale_as<_Float16>(data, nbytes / 2, factor);
      return;
#else
      throw std::invalid_argument("rescale fill of float16 payloads needs a compiler with _Float16");
#endif
    case ElementKind::kOpaque:
      return;
  }
}

FillMode parse_fill_mode(const std::string& name) {
  if (name == "zeros") return FillMode::kZeros;
  if (name == "stale") return FillMode::kStale;
  if (name == "rescale") return FillMode::kRescale;
  throw std::invalid_argument("unknown loss fill '" + name + "'; choose zeros, stale or rescale");
}

}  // namespace mapp
