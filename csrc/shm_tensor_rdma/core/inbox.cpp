#include "inbox.h"

#include <algorithm>
#include <memory>
#include <utility>

namespace mapp {

void Inbox::set_arrival_filter(std::shared_ptr<ArrivalFilter> filter) { std::atomic_store(&filter_, std::move(filter)); }

void Inbox::put(int peer, Message message) {
  if (std::shared_ptr<ArrivalFilter> filter = std::atomic_load(&filter_)) {
    filter->on_arrival(peer, message.header, message.payload.data());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const MessageKey key(peer, message.header.tag);
  by_key_[key].push_back(Arrival{next_sequence_++, std::move(message)});
  ++count_;
}

std::optional<Message> Inbox::take(const MessageKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = by_key_.find(key);
  if (found == by_key_.end()) return std::nullopt;
  Message message = std::move(found->second.front().message);
  found->second.pop_front();
  if (found->second.empty()) by_key_.erase(found);
  --count_;
  return message;
}

std::optional<MessageHeader> Inbox::peek(const MessageKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = by_key_.find(key);
  if (found == by_key_.end()) return std::nullopt;
  return found->second.front().message.header;
}

std::optional<MessageKey> Inbox::find_any(const std::vector<MessageKey>& keys) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (count_ == 0) return std::nullopt;
  for (const MessageKey& key : keys) {
    if (by_key_.count(key) != 0) return key;
  }
  return std::nullopt;
}

std::vector<MessageKey> Inbox::ready() const {
  std::vector<std::pair<uint64_t, MessageKey>> ordered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ordered.reserve(count_);
    for (const auto& [key, arrivals] : by_key_) {
      for (const Arrival& arrival : arrivals) ordered.emplace_back(arrival.sequence, key);
    }
  }
  std::sort(ordered.begin(), ordered.end());
  std::vector<MessageKey> keys;
  keys.reserve(ordered.size());
  for (const auto& item : ordered) keys.push_back(item.second);
  return keys;
}

size_t Inbox::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return count_;
}

}  // namespace mapp
