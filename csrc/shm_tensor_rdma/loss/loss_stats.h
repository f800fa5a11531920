// Counters of one loss stream: packets seen and lost, and how long the runs of consecutive losses were.
#pragma once

#include <cstdint>
#include <map>

namespace mapp {

struct LossStatsSnapshot {
  uint64_t packets = 0;
  uint64_t lost = 0;
  // burst length (consecutive lost packets) -> number of such bursts, for bursts that have ended
  std::map<uint64_t, uint64_t> bursts;
  uint64_t open_burst = 0;  // length of the run of losses still going on
};

class LossStats {
 public:
  void record(bool lost) {
    ++snapshot_.packets;
    if (lost) {
      ++snapshot_.lost;
      ++snapshot_.open_burst;
    } else if (snapshot_.open_burst != 0) {
      ++snapshot_.bursts[snapshot_.open_burst];
      snapshot_.open_burst = 0;
    }
  }
  // `count` packets in a row, all delivered.
  void record_delivered(uint64_t count) {
    if (count == 0) return;
    snapshot_.packets += count;
    if (snapshot_.open_burst != 0) {
      ++snapshot_.bursts[snapshot_.open_burst];
      snapshot_.open_burst = 0;
    }
  }
  const LossStatsSnapshot& snapshot() const { return snapshot_; }

 private:
  LossStatsSnapshot snapshot_;
};

}  // namespace mapp
