#include "peer_connector.h"

#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>

#include "errors.h"
#include "peer_name.h"
#include "shm_segment.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {
namespace {

// Fallback re-check period; inotify normally wakes the thread as soon as a segment appears.
constexpr int kRecheckWithInotifyMs = 1000;
constexpr int kRecheckWithoutInotifyMs = 100;

void drain_fd(int fd) {
  char buffer[4096];
  while (::read(fd, buffer, sizeof(buffer)) > 0) {
  }
}

}  // namespace

PeerConnector::PeerConnector(std::string job_id, int my_rank, int world_size, const std::vector<int>& peers)
    : job_id_(std::move(job_id)), my_rank_(my_rank), world_size_(world_size) {
  for (int peer : peers) links_[peer];
  inotify_.reset(::inotify_init1(IN_CLOEXEC | IN_NONBLOCK));
  if (inotify_.valid() && ::inotify_add_watch(inotify_.get(), kShmDirectory, IN_CREATE | IN_MOVED_TO) < 0) {
    inotify_.reset();
  }
  thread_ = std::thread([this] { run(); });
}

PeerConnector::~PeerConnector() { stop(); }

void PeerConnector::stop() {
  if (!stopping_.exchange(true)) stop_.signal();
  if (thread_.joinable()) thread_.join();
  inotify_.reset();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [peer, link] : links_) {
      if (link.channel) link.channel->mark_producer_closed();
    }
  }
  link_changed_.notify_all();
}

void PeerConnector::run() {
  while (!stopping_.load(std::memory_order_acquire)) {
    if (attach_missing()) break;
    struct pollfd fds[2];
    fds[0] = {stop_.fd(), POLLIN, 0};
    fds[1] = {inotify_.get(), POLLIN, 0};
    const nfds_t count = inotify_.valid() ? 2 : 1;
    ::poll(fds, count, inotify_.valid() ? kRecheckWithInotifyMs : kRecheckWithoutInotifyMs);
    if (inotify_.valid()) drain_fd(inotify_.get());
  }
}

bool PeerConnector::attach_missing() {
  std::vector<int> missing;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [peer, link] : links_) {
      if (!link.channel && !link.error) missing.push_back(peer);
    }
  }
  if (missing.empty()) return true;
  bool settled = true;
  for (int peer : missing) {
    Link attempt;
    try {
      attempt.channel = ShmChannel::attach(job_id_, my_rank_, world_size_, peer);
    } catch (...) {
      attempt.error = std::current_exception();
    }
    if (!attempt.channel && !attempt.error) {
      settled = false;
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      links_[peer] = std::move(attempt);
    }
    link_changed_.notify_all();
  }
  return settled;
}

ShmChannel* PeerConnector::channel_if_ready(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = links_.find(peer);
  return found == links_.end() ? nullptr : found->second.channel.get();
}

ShmChannel& PeerConnector::wait_channel(int peer, uint64_t tag, double timeout_s, const std::atomic<bool>& stopping) {
  using Clock = std::chrono::steady_clock;
  const auto give_up_at = deadline_after(timeout_s);
  std::unique_lock<std::mutex> lock(mutex_);
  Link& link = links_.at(peer);
  for (;;) {
    if (link.channel) return *link.channel;
    if (link.error) std::rethrow_exception(link.error);
    if (stopping.load() || stopping_.load()) {
      throw ClosedError("transport closed while rank " + std::to_string(my_rank_) + " waited for " + peer_name(peer) +
                        " to start (sending " + describe_tag(tag) + ")");
    }
    if (Clock::now() >= give_up_at) {
      throw TimeoutError("timed out after " + format_seconds(timeout_s) + " waiting for " + peer_name(peer) +
                         " to start (rank " + std::to_string(my_rank_) + " was sending " +
                         describe_tag(tag) + ")");
    }
    link_changed_.wait_until(lock, give_up_at);
  }
}

std::optional<ProcessIdentity> PeerConnector::owner_of(int peer) {
  ShmChannel* channel = channel_if_ready(peer);
  if (channel == nullptr) return std::nullopt;
  return channel->owner();
}

bool PeerConnector::peer_closed(int peer) {
  ShmChannel* channel = channel_if_ready(peer);
  return channel != nullptr && channel->owner_closed();
}

void PeerConnector::wake_senders() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [peer, link] : links_) {
      if (link.channel) link.channel->wake_sender();
    }
  }
  link_changed_.notify_all();
}

}  // namespace mapp
