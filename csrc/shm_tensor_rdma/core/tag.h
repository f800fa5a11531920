// 64-bit message tags: | direction (4 bits) | iteration (28 bits) | virtual microbatch (32 bits) |.
// Any 64-bit value is a valid tag on the wire; this layout only gives tags made by make_tag a readable name.
#pragma once

#include <cstdint>
#include <string>

namespace mapp {

enum class Direction : uint32_t { kForward = 1, kBackward = 2, kControl = 3 };

constexpr int kMicrobatchBits = 32;
constexpr int kIterationBits = 28;
constexpr int kDirectionBits = 4;

struct TagParts {
  uint32_t direction;
  uint64_t microbatch;
  uint64_t iteration;
};

// Throws std::invalid_argument when a field does not fit its bits or the direction is unknown.
uint64_t make_tag(uint32_t direction, uint64_t microbatch, uint64_t iteration);
// Throws std::invalid_argument for a tag whose direction bits are not a known Direction.
TagParts split_tag(uint64_t tag);
// "FORWARD vmb=5 iter=0" for tags made by make_tag, "tag 0x..." otherwise.
std::string describe_tag(uint64_t tag);

}  // namespace mapp
