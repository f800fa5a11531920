// Packet loss models: which packets of a stream are lost. Bernoulli(p), Gilbert-Elliott with netem's gemodel
// parameters, and replay of a recorded pattern. Each stream (link + direction) owns one process, seeded from
// (seed, link, direction), so runs repeat exactly and links are independent.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace mapp {

enum class LossModelKind : uint32_t { kNone = 0, kBernoulli = 1, kGilbertElliott = 2, kReplay = 3 };

struct LossModelSpec {
  LossModelKind kind = LossModelKind::kNone;
  double loss_rate = 0.0;  // Bernoulli: probability that a packet is lost
  // Gilbert-Elliott, as netem's `loss gemodel p r 1-h 1-k` (fractions, not percent):
  double p = 0.0;          // good -> bad transition probability per packet
  double r = 1.0;          // bad -> good transition probability per packet
  double bad_loss = 1.0;   // 1-h: loss probability in the bad state
  double good_loss = 0.0;  // 1-k: loss probability in the good state
  std::vector<uint8_t> pattern;  // replay: 1 = lost, repeated cyclically

  // Throws std::invalid_argument naming the bad parameter.
  void validate() const;
  // Long-run fraction of packets lost.
  double stationary_loss_rate() const;
};

// One stream's packet decisions; not thread-safe (its LossChannel serialises calls).
class PacketLossProcess {
 public:
  virtual ~PacketLossProcess() = default;
  virtual bool next_lost() = 0;
  // True when no packet can ever be lost from now on (p = 0): lets the caller skip the per-packet draws.
  virtual bool never_loses() const { return false; }
};

std::unique_ptr<PacketLossProcess> make_loss_process(const LossModelSpec& spec, uint64_t stream_seed);

// Seed of one stream: mixes the run's seed with what names the stream (link ends, direction, traffic kind).
uint64_t mix_stream_seed(uint64_t seed, std::initializer_list<uint64_t> parts);

}  // namespace mapp
