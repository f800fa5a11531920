// Attaches this rank's send channels to every peer's receive segment, in the background, as the segments appear.
// Waits for new segments with inotify on /dev/shm (the thread sleeps in poll(); a slow timer is only a fallback).
// Attaching early, rather than on the first send, lets every segment name be removed soon after start-up.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "process_identity.h"
#include "shm_channel.h"
#include "unique_fd.h"

namespace mapp {

class PeerConnector {
 public:
  PeerConnector(std::string job_id, int my_rank, int world_size, const std::vector<int>& peers);
  ~PeerConnector();  // stop()
  PeerConnector(const PeerConnector&) = delete;
  PeerConnector& operator=(const PeerConnector&) = delete;

  // The channel to `peer` if attached already, else nullptr. Never blocks.
  ShmChannel* channel_if_ready(int peer);
  // Blocks until the channel to `peer` exists. Throws TimeoutError (naming peer and tag) after timeout_s,
  // ClosedError after stop(), or the error that made attaching impossible.
  ShmChannel& wait_channel(int peer, uint64_t tag, double timeout_s, const std::atomic<bool>& stopping);
  // Identity of `peer`'s process once attached.
  std::optional<ProcessIdentity> owner_of(int peer);
  bool peer_closed(int peer);
  // Wakes our threads blocked in a channel's send() or in wait_channel() so they re-check why they wait.
  void wake_senders();
  // Stops attaching and tells every attached peer that we will send nothing more. Idempotent.
  void stop();

 private:
  struct Link {
    std::unique_ptr<ShmChannel> channel;
    std::exception_ptr error;
  };

  void run();
  bool attach_missing();  // true when every link is settled

  const std::string job_id_;
  const int my_rank_;
  const int world_size_;
  std::mutex mutex_;
  std::condition_variable link_changed_;
  std::unordered_map<int, Link> links_;
  std::atomic<bool> stopping_{false};
  UniqueFd inotify_;  // invalid where inotify is unavailable: the thread re-checks on a timer
  EventFd stop_;      // interrupts the thread's poll()
  std::thread thread_;
};

}  // namespace mapp
