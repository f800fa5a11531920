// The loss layer of a transport: sees every complete message before the inbox publishes it (all backends pass
// there) and applies one LossChannel per (sending peer, direction) to its payload. Headers, shapes and tags are
// never touched, so a lost packet can change values but never stall or break a receive.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "inbox.h"
#include "loss_channel.h"

namespace mapp {

struct LossInjectorConfig {
  LossChannelConfig channel;
  uint64_t seed = 0;
  int local_rank = 0;  // the receiving end of every link this injector sees
  bool forward = true;   // activations (Direction::kForward tags)
  bool backward = true;  // gradients (Direction::kBackward tags)
  std::unordered_map<uint32_t, ElementType> element_types;  // dtype code -> element; unknown codes are opaque bytes
};

struct LinkLossStats {
  int source;
  int destination;
  uint32_t direction;
  LossStatsSnapshot stats;
};

class LossInjector final : public ArrivalFilter {
 public:
  explicit LossInjector(LossInjectorConfig config);
  void on_arrival(int peer, const MessageHeader& header, uint8_t* payload) override;
  // One entry per link and direction that carried traffic so far, ordered by (source, direction).
  std::vector<LinkLossStats> stats() const;

 private:
  LossChannel& channel_for(int peer, uint32_t direction);

  const LossInjectorConfig config_;
  mutable std::mutex mutex_;
  std::map<std::pair<int, uint32_t>, std::unique_ptr<LossChannel>> channels_;
};

// Stale fill reuses the payload last delivered with the same tag family: the tag without its iteration field,
// i.e. the same (direction, virtual microbatch) of the previous forward_backward call on that link.
uint64_t stale_family_of(uint64_t tag);

}  // namespace mapp
