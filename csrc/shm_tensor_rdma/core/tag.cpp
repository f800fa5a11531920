#include "tag.h"

#include <cstdio>
#include <stdexcept>

namespace mapp {
namespace {

constexpr uint64_t kMicrobatchLimit = uint64_t{1} << kMicrobatchBits;
constexpr uint64_t kIterationLimit = uint64_t{1} << kIterationBits;

const char* direction_name(uint32_t direction) {
  switch (static_cast<Direction>(direction)) {
    case Direction::kForward: return "FORWARD";
    case Direction::kBackward: return "BACKWARD";
    case Direction::kControl: return "CONTROL";
  }
  return nullptr;
}

}  // namespace

uint64_t make_tag(uint32_t direction, uint64_t microbatch, uint64_t iteration) {
  if (direction_name(direction) == nullptr) {
    throw std::invalid_argument("unknown direction code " + std::to_string(direction));
  }
  if (microbatch >= kMicrobatchLimit) {
    throw std::invalid_argument("virtual_microbatch " + std::to_string(microbatch) + " does not fit in " +
                                std::to_string(kMicrobatchBits) + " bits");
  }
  if (iteration >= kIterationLimit) {
    throw std::invalid_argument("iteration " + std::to_string(iteration) + " does not fit in " +
                                std::to_string(kIterationBits) + " bits");
  }
  return (uint64_t{direction} << (kMicrobatchBits + kIterationBits)) | (iteration << kMicrobatchBits) | microbatch;
}

TagParts split_tag(uint64_t tag) {
  TagParts parts{static_cast<uint32_t>(tag >> (kMicrobatchBits + kIterationBits)), tag & (kMicrobatchLimit - 1),
                 (tag >> kMicrobatchBits) & (kIterationLimit - 1)};
  if (direction_name(parts.direction) == nullptr) {
    char text[96];
    std::snprintf(text, sizeof(text), "tag 0x%016llx was not made by make_tag (direction bits %u)",
                  static_cast<unsigned long long>(tag), parts.direction);
    throw std::invalid_argument(text);
  }
  return parts;
}

std::string describe_tag(uint64_t tag) {
  const uint32_t direction = static_cast<uint32_t>(tag >> (kMicrobatchBits + kIterationBits));
  const char* name = direction_name(direction);
  char text[96];
  if (name == nullptr) {
    std::snprintf(text, sizeof(text), "tag 0x%016llx", static_cast<unsigned long long>(tag));
  } else {
    const TagParts parts = split_tag(tag);
    std::snprintf(text, sizeof(text), "tag %s vmb=%llu iter=%llu", name,
                  static_cast<unsigned long long>(parts.microbatch), static_cast<unsigned long long>(parts.iteration));
  }
  return text;
}

}  // namespace mapp
