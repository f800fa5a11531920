// One loss stream (a link in one direction, or one kind of tensor-parallel traffic): its model's state, its
// statistics and, for stale fill, the last payload delivered at each place. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "loss_fill.h"
#include "loss_model.h"
#include "loss_stats.h"

namespace mapp {

struct LossChannelConfig {
  LossModelSpec model;
  FillMode fill = FillMode::kZeros;
  uint64_t packet_bytes = 4096;
  // Loss rate p of the 1/(1-p) rescale; default: the model's stationary rate. Caller-made masks (plug-ins) need it.
  std::optional<double> rescale_rate;

  void validate() const;  // std::invalid_argument naming the bad setting
  double effective_rescale_rate() const;
};

class LossChannel {
 public:
  LossChannel(LossChannelConfig config, uint64_t stream_seed);

  // Cuts the payload into packets of config.packet_bytes, lets the model keep or lose each, and fills the lost
  // ones in place. Payloads of one `family` are successive values of one place (what stale fill reuses).
  void apply(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family);
  // The same with the caller's decisions: keep[i] != 0 delivers the i-th of `parts` near-equal runs of elements.
  void apply_mask(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family, const uint8_t* keep,
                  uint64_t parts);
  // Only counts: keep[i] != 0 for each of `parts` packets whose fate the caller decided and applied itself.
  void record_mask(const uint8_t* keep, uint64_t parts);
  LossStatsSnapshot stats() const;
  const LossChannelConfig& config() const { return config_; }

 private:
  void fill(uint8_t* data, uint64_t nbytes, ElementType type, uint64_t family, std::vector<ByteRange>& lost);

  const LossChannelConfig config_;
  const double rescale_factor_;
  mutable std::mutex mutex_;
  std::unique_ptr<PacketLossProcess> process_;
  LossStats stats_;
  std::unordered_map<uint64_t, std::vector<uint8_t>> last_delivered_;  // stale fill only
  std::vector<ByteRange> lost_;                                         // scratch, reused across calls
};

}  // namespace mapp
