#include "worker_pool.h"

#include "errors.h"

namespace mapp {

WorkerPool::WorkerPool(size_t num_threads) {
  threads_.reserve(num_threads);
  for (size_t i = 0; i < num_threads; ++i) threads_.emplace_back([this] { worker_loop(); });
}

WorkerPool::~WorkerPool() { shutdown(); }

void WorkerPool::submit(int key, Task task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) throw ClosedError("transport is closed");
    Lane& lane = lanes_[key];
    lane.queue.push_back(std::move(task));
    if (lane.busy || lane.queue.size() > 1) return;  // already scheduled or running
    ready_keys_.push_back(key);
  }
  work_ready_.notify_one();
}

bool WorkerPool::run_inline_if_idle(int key, const std::function<bool()>& attempt) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Lane& lane = lanes_[key];
    if (stopping_ || lane.busy || !lane.queue.empty()) return false;
    lane.busy = true;
    ++busy_lanes_;
  }
  bool done = false;
  try {
    done = attempt();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    finish_turn(key);
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  finish_turn(key);
  return done;
}

void WorkerPool::finish_turn(int key) {
  Lane& lane = lanes_[key];
  lane.busy = false;
  --busy_lanes_;
  if (!lane.queue.empty()) {
    ready_keys_.push_back(key);
    work_ready_.notify_one();
  } else if (stopping_ && busy_lanes_ == 0) {
    work_ready_.notify_all();  // let idle workers exit
  }
}

void WorkerPool::worker_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    // While stopping, stay until no lane is busy: a busy lane may still queue work when its turn ends.
    work_ready_.wait(lock, [this] { return !ready_keys_.empty() || (stopping_ && busy_lanes_ == 0); });
    if (ready_keys_.empty()) return;
    const int key = ready_keys_.front();
    ready_keys_.pop_front();
    Lane& lane = lanes_[key];
    Task task = std::move(lane.queue.front());
    lane.queue.pop_front();
    lane.busy = true;
    ++busy_lanes_;
    lock.unlock();
    task();
    task = nullptr;  // release captures outside the lock
    lock.lock();
    finish_turn(key);
  }
}

void WorkerPool::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& thread : threads_) {
    if (thread.joinable()) thread.join();
  }
  threads_.clear();
}

}  // namespace mapp
