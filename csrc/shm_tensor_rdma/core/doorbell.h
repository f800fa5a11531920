// An event count over a futex word that may live in shared memory: ring() wakes every thread, in any process,
// blocked in wait() on the same word. wait() sleeps in the kernel; spin_wait() first polls for a bounded time.
//
//   uint32_t seen = bell.snapshot();
//   if (!condition()) bell.wait(seen, timeout);   // returns at once if ring() happened after snapshot()
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace mapp {

struct DoorbellWords {
  std::atomic<uint32_t> sequence{0};
  std::atomic<uint32_t> waiters{0};
};
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words must be plain 32-bit words");

class Doorbell {
 public:
  explicit Doorbell(DoorbellWords* words) : words_(words) {}

  uint32_t snapshot() const { return words_->sequence.load(std::memory_order_seq_cst); }
  void ring();
  // Sleeps until ring() after `seen` was taken, the timeout, or a spurious wake-up.
  void wait(uint32_t seen, std::chrono::nanoseconds timeout);
  // Like wait(), but first polls for up to `spin` (yielding the CPU between polls): a ring() that comes within
  // that time then costs neither side a system call nor a wake-up, which on a virtual machine with idle CPUs is
  // the largest part of a small message's latency. Bounded, so a long wait still sleeps at ~0% CPU.
  void spin_wait(uint32_t seen, std::chrono::nanoseconds spin, std::chrono::nanoseconds timeout);

 private:
  DoorbellWords* words_;
};

}  // namespace mapp
