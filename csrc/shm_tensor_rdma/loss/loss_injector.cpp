#include "loss_injector.h"

#include <exception>

#include "tag.h"

namespace mapp {
namespace {

constexpr int kDirectionShift = kMicrobatchBits + kIterationBits;
constexpr uint64_t kIterationMask = ((uint64_t{1} << kIterationBits) - 1) << kMicrobatchBits;
constexpr uint64_t kPipelineTrafficSalt = 0x5049504500000000ULL;  // "PIPE": keeps these streams apart from TP ones

}  // namespace

uint64_t stale_family_of(uint64_t tag) { return tag & ~kIterationMask; }

LossInjector::LossInjector(LossInjectorConfig config) : config_(std::move(config)) { config_.channel.validate(); }

void LossInjector::on_arrival(int peer, const MessageHeader& header, uint8_t* payload) {
  if (header.nbytes == 0) return;
  const uint32_t direction = static_cast<uint32_t>(header.tag >> kDirectionShift);
  const bool subject = (direction == static_cast<uint32_t>(Direction::kForward) && config_.forward) ||
                       (direction == static_cast<uint32_t>(Direction::kBackward) && config_.backward);
  if (!subject) return;  // control messages and tags of other layouts always arrive intact
  ElementType type;
  const auto known = config_.element_types.find(header.dtype_code);
  if (known != config_.element_types.end()) type = known->second;
  try {
    channel_for(peer, direction).apply(payload, header.nbytes, type, stale_family_of(header.tag));
  } catch (const std::exception&) {
    // Runs on a receive thread: loss emulation must never take the transport down (only bad_alloc can land here).
  }
}

LossChannel& LossInjector::channel_for(int peer, uint32_t direction) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::unique_ptr<LossChannel>& channel = channels_[{peer, direction}];
  if (!channel) {
    const uint64_t seed = mix_stream_seed(
        config_.seed, {kPipelineTrafficSalt, static_cast<uint64_t>(peer), static_cast<uint64_t>(config_.local_rank),
                       direction});
    channel = std::make_unique<LossChannel>(config_.channel, seed);
  }
  return *channel;
}

std::vector<LinkLossStats> LossInjector::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<LinkLossStats> result;
  for (const auto& [key, channel] : channels_) {
    result.push_back(LinkLossStats{key.first, config_.local_rank, key.second, channel->stats()});
  }
  return result;
}

}  // namespace mapp
