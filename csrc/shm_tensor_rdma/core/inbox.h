// This process's table of fully arrived messages, keyed by (peer, tag), in arrival order. Thread-safe.
// Backends put() completed messages; callers look them up and take them. Waiting for arrivals is done on the
// transport's arrival doorbell, which every backend rings.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "buffer_pool.h"
#include "message.h"

namespace mapp {

struct Message {
  MessageHeader header;
  PooledBuffer payload;
};

// Sees, and may change in place, every complete payload before it is published: the loss layer's hook point.
class ArrivalFilter {
 public:
  virtual ~ArrivalFilter() = default;
  virtual void on_arrival(int peer, const MessageHeader& header, uint8_t* payload) = 0;
};

class Inbox {
 public:
  void put(int peer, Message message);
  // Installs (or, with nullptr, removes) the filter every later put() runs first, on the putting thread.
  void set_arrival_filter(std::shared_ptr<ArrivalFilter> filter);
  // Removes and returns the oldest message with this key.
  std::optional<Message> take(const MessageKey& key);
  std::optional<MessageHeader> peek(const MessageKey& key) const;
  // The first of `keys` (in the given order) that has a message.
  std::optional<MessageKey> find_any(const std::vector<MessageKey>& keys) const;
  // One key per waiting message, oldest arrival first.
  std::vector<MessageKey> ready() const;
  size_t size() const;

 private:
  struct Arrival {
    uint64_t sequence;
    Message message;
  };

  std::shared_ptr<ArrivalFilter> filter_;  // read and written with std::atomic_load/atomic_store
  mutable std::mutex mutex_;
  std::unordered_map<MessageKey, std::deque<Arrival>, MessageKeyHash> by_key_;
  uint64_t next_sequence_ = 0;
  size_t count_ = 0;
};

}  // namespace mapp
