// What a lost packet becomes at the receiver: zeros, the bytes last delivered at that place (stale), or zeros
// with every delivered element scaled by 1/(1-p) so the expectation is unchanged (rescale).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace mapp {

enum class FillMode : uint32_t { kZeros = 0, kStale = 1, kRescale = 2 };

// How the bytes of a payload group into elements. Only the float kinds can be rescaled; other kinds are zeroed.
enum class ElementKind : uint32_t { kOpaque = 0, kFloat16 = 1, kBFloat16 = 2, kFloat32 = 3, kFloat64 = 4 };

struct ElementType {
  uint32_t size = 1;
  ElementKind kind = ElementKind::kOpaque;
};

struct ByteRange {
  uint64_t begin;
  uint64_t end;
};

// Widens each range to whole elements (a packet boundary inside an element loses the element) and clamps to nbytes.
void widen_to_elements(std::vector<ByteRange>& ranges, uint64_t element_size, uint64_t nbytes);
void zero_ranges(uint8_t* data, const std::vector<ByteRange>& ranges);
// Copies each range from `previous` (same size as data).
void restore_ranges(uint8_t* data, const std::vector<ByteRange>& ranges, const uint8_t* previous);
// Multiplies every element by `factor`; no-op for opaque kinds. Throws std::invalid_argument for float16 when the
// compiler has no _Float16.
void scale_elements(uint8_t* data, uint64_t nbytes, ElementType type, double factor);

FillMode parse_fill_mode(const std::string& name);  // zeros | stale | rescale; std::invalid_argument otherwise

}  // namespace mapp
