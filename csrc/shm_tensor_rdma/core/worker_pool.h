// A fixed set of threads running tasks grouped by key (the destination peer): tasks with the same key run one
// at a time in submission order; different keys run in parallel. Keys take turns, one task per turn, so one
// slow peer cannot starve the others while a thread is free.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

namespace mapp {

class WorkerPool {
 public:
  using Task = std::function<void()>;

  explicit WorkerPool(size_t num_threads);
  ~WorkerPool();  // shutdown()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Tasks must not throw. Throws ClosedError after shutdown() began.
  void submit(int key, Task task);
  // Runs `attempt` on the calling thread if nothing is queued or running for `key`; returns its result, or false
  // without calling it when the key is busy. Keeps per-key order: no task of `key` starts meanwhile.
  bool run_inline_if_idle(int key, const std::function<bool()>& attempt);
  // Runs every queued task, then joins the threads. Idempotent.
  void shutdown();

 private:
  struct Lane {
    std::deque<Task> queue;
    bool busy = false;
  };

  void worker_loop();
  void finish_turn(int key);  // caller holds mutex_

  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::unordered_map<int, Lane> lanes_;
  std::deque<int> ready_keys_;  // keys with queued work whose lane is not busy
  size_t busy_lanes_ = 0;        // lanes running a task (on a worker or inline)
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace mapp
