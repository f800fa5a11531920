#include "loss_channel.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mapp {
namespace {

// Appends [begin, end), merging with the previous range when they touch.
void add_lost(std::vector<ByteRange>& lost, uint64_t begin, uint64_t end) {
  if (!lost.empty() && lost.back().end == begin) {
    lost.back().end = end;
  } else {
    lost.push_back(ByteRange{begin, end});
  }
}

}  // namespace

void LossChannelConfig::validate() const {
  model.validate();
  if (packet_bytes < 1) throw std::invalid_argument("loss packet size must be at least 1 byte");
  if (rescale_rate && !(*rescale_rate >= 0.0 && *rescale_rate <= 1.0)) {
    throw std::invalid_argument("rescale loss rate must be in [0, 1], got " + std::to_string(*rescale_rate));
  }
}

double LossChannelConfig::effective_rescale_rate() const {
  return rescale_rate ? *rescale_rate : model.stationary_loss_rate();
}

LossChannel::LossChannel(LossChannelConfig config, uint64_t stream_seed)
    : config_((config.validate(), std::move(config))),
      rescale_factor_(config_.effective_rescale_rate() < 1.0 ? 1.0 / (1.0 - config_.effective_rescale_rate())
                                                              : 1.0),
      process_(make_loss_process(config_.model, stream_seed)) {}

void LossChannel::apply(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family) {
  std::lock_guard<std::mutex> lock(mutex_);
  lost_.clear();
  const uint64_t step = config_.packet_bytes;
  if (process_->never_loses()) {  // p = 0: count the packets, draw nothing
    stats_.record_delivered((nbytes + step - 1) / step);
    if (config_.fill == FillMode::kZeros) return;  // nothing to fill (stale still remembers, rescale still scales)
  } else {
    for (uint64_t begin = 0; begin < nbytes; begin += step) {
      const bool lost = process_->next_lost();
      stats_.record(lost);
      if (lost) add_lost(lost_, begin, std::min(nbytes, begin + step));
    }
  }
  fill(data, nbytes, type, family, lost_);
}

void LossChannel::apply_mask(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family, const uint8_t* keep,
                             uint64_t parts) {
  const uint64_t element = std::max<uint32_t>(1, type.size);
  const uint64_t elements = nbytes / element;
  if (parts == 0 || parts > std::max<uint64_t>(1, elements)) {
    throw std::invalid_argument("a loss mask needs between 1 and " + std::to_string(std::max<uint64_t>(1, elements)) +
                                " entries for this tensor, got " + std::to_string(parts));
  }
  const uint64_t per_part = (elements + parts - 1) / parts;  // elements per part; the last part may be short
  std::lock_guard<std::mutex> lock(mutex_);
  lost_.clear();
  for (uint64_t i = 0; i < parts; ++i) {
    const bool lost = keep[i] == 0;
    stats_.record(lost);
    const uint64_t begin = std::min(elements, i * per_part) * element;
    const uint64_t end = std::min(elements, (i + 1) * per_part) * element;
    if (lost && end > begin) add_lost(lost_, begin, end);
  }
  fill(data, nbytes, type, family, lost_);
}

void LossChannel::fill(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family,
                       std::vector<ByteRange>& lost) {
  widen_to_elements(lost, std::max<uint32_t>(1, type.size), nbytes);
  switch (config_.fill) {
    case FillMode::kZeros:
      zero_ranges(data, lost);
      return;
    case FillMode::kRescale:
      zero_ranges(data, lost);
      scale_elements(data, nbytes, type, rescale_factor_);
      return;
    case FillMode::kStale: {
      std::vector<uint8_t>& previous = last_delivered_[family];
      if (previous.size() == nbytes) {
        restore_ranges(data, lost, previous.data());
      } else {
        zero_ranges(data, lost);  // nothing of this size arrived here before
      }
      previous.assign(data, data + nbytes);
      return;
    }
  }
}

void LossChannel::record_mask(const uint8_t* keep, uint64_t parts) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (uint64_t i = 0; i < parts; ++i) stats_.record(keep[i] == 0);
}

LossStatsSnapshot LossChannel::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_.snapshot();
}

}  // namespace mapp
