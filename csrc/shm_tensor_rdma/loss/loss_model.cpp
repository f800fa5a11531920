#include "loss_model.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace mapp {
namespace {

void require_probability(double value, const char* name) {
  if (!(value >= 0.0 && value <= 1.0)) {
    throw std::invalid_argument(std::string(name) + " must be a probability in [0, 1], got " + std::to_string(value));
  }
}

// Uniform draws in [0, 1) with 53 random bits: the same sequence on every platform for a given seed
// (std::uniform_real_distribution is implementation-defined).
class UnitDraws {
 public:
  explicit UnitDraws(uint64_t seed) : engine_(seed) {}
  bool below(double probability) { return static_cast<double>(engine_() >> 11) * 0x1.0p-53 < probability; }

 private:
  std::mt19937_64 engine_;
};

class NoLoss final : public PacketLossProcess {
 public:
  bool next_lost() override { return false; }
  bool never_loses() const override { return true; }
};

class BernoulliLoss final : public PacketLossProcess {
 public:
  BernoulliLoss(double rate, uint64_t seed) : rate_(rate), draws_(seed) {}
  bool next_lost() override { return draws_.below(rate_); }
  bool never_loses() const override { return rate_ == 0.0; }

 private:
  const double rate_;
  UnitDraws draws_;
};

// netem's order: the packet's fate depends on the current state, then the state may change.
class GilbertElliottLoss final : public PacketLossProcess {
 public:
  GilbertElliottLoss(const LossModelSpec& spec, uint64_t seed) : spec_(spec), draws_(seed) {
    // Start in the stationary distribution so short runs are not biased towards the good state.
    const double bad_share = spec.p + spec.r > 0 ? spec.p / (spec.p + spec.r) : 0.0;
    bad_ = draws_.below(bad_share);
  }
  bool next_lost() override {
    const bool lost = draws_.below(bad_ ? spec_.bad_loss : spec_.good_loss);
    bad_ = bad_ ? !draws_.below(spec_.r) : draws_.below(spec_.p);
    return lost;
  }
  bool never_loses() const override { return !bad_ && spec_.p == 0.0 && spec_.good_loss == 0.0; }

 private:
  const LossModelSpec spec_;
  UnitDraws draws_;
  bool bad_;
};

class ReplayLoss final : public PacketLossProcess {
 public:
  explicit ReplayLoss(std::vector<uint8_t> pattern)
      : pattern_(std::move(pattern)),
        lossless_(std::all_of(pattern_.begin(), pattern_.end(), [](uint8_t packet) { return packet == 0; })) {}
  bool never_loses() const override { return lossless_; }
  bool next_lost() override {
    const bool lost = pattern_[position_] != 0;
    position_ = (position_ + 1) % pattern_.size();
    return lost;
  }

 private:
  const std::vector<uint8_t> pattern_;
  const bool lossless_;
  size_t position_ = 0;
};

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

void LossModelSpec::validate() const {
  switch (kind) {
    case LossModelKind::kNone:
      return;
    case LossModelKind::kBernoulli:
      require_probability(loss_rate, "loss rate");
      return;
    case LossModelKind::kGilbertElliott:
      require_probability(p, "Gilbert-Elliott p (good->bad)");
      require_probability(r, "Gilbert-Elliott r (bad->good)");
      require_probability(bad_loss, "Gilbert-Elliott 1-h (loss in the bad state)");
      require_probability(good_loss, "Gilbert-Elliott 1-k (loss in the good state)");
      return;
    case LossModelKind::kReplay:
      if (pattern.empty()) throw std::invalid_argument("a replayed loss pattern needs at least one packet");
      return;
  }
  throw std::invalid_argument("unknown loss model kind " + std::to_string(static_cast<uint32_t>(kind)));
}

double LossModelSpec::stationary_loss_rate() const {
  switch (kind) {
    case LossModelKind::kNone:
      return 0.0;
    case LossModelKind::kBernoulli:
      return loss_rate;
    case LossModelKind::kGilbertElliott: {
      if (p + r == 0.0) return good_loss;  // never leaves the (initial, good) state
      const double bad_share = p / (p + r);
      return (1.0 - bad_share) * good_loss + bad_share * bad_loss;
    }
    case LossModelKind::kReplay: {
      size_t lost = 0;
      for (uint8_t packet : pattern) lost += packet != 0;
      return pattern.empty() ? 0.0 : static_cast<double>(lost) / static_cast<double>(pattern.size());
    }
  }
  return 0.0;
}

std::unique_ptr<PacketLossProcess> make_loss_process(const LossModelSpec& spec, uint64_t stream_seed) {
  spec.validate();
  switch (spec.kind) {
    case LossModelKind::kBernoulli:
      return std::make_unique<BernoulliLoss>(spec.loss_rate, stream_seed);
    case LossModelKind::kGilbertElliott:
      return std::make_unique<GilbertElliottLoss>(spec, stream_seed);
    case LossModelKind::kReplay:
      return std::make_unique<ReplayLoss>(spec.pattern);
    case LossModelKind::kNone:
      break;
  }
  return std::make_unique<NoLoss>();
}

uint64_t mix_stream_seed(uint64_t seed, std::initializer_list<uint64_t> parts) {
  uint64_t mixed = splitmix64(seed);
  for (uint64_t part : parts) mixed = splitmix64(mixed ^ splitmix64(part + 0x632BE59BD9B4E019ULL));
  return mixed;
}

}  // namespace mapp
