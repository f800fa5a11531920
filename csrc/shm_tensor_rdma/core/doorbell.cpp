#include "doorbell.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

namespace mapp {
namespace {

// Not FUTEX_PRIVATE: the word may be shared between processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// A sched_yield() that returns later than this handed the CPU to another task.
constexpr std::chrono::microseconds kYieldGaveAwayCpu(10);

}  // namespace

void Doorbell::ring() {
  words_->sequence.fetch_add(1, std::memory_order_seq_cst);
  if (words_->waiters.load(std::memory_order_seq_cst) != 0) futex(&words_->sequence, FUTEX_WAKE, INT_MAX, nullptr);
}

void Doorbell::wait(uint32_t seen, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  struct timespec relative;
  relative.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  relative.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  words_->waiters.fetch_add(1, std::memory_order_seq_cst);
  if (words_->sequence.load(std::memory_order_seq_cst) == seen) {
    futex(&words_->sequence, FUTEX_WAIT, seen, &relative);  // EAGAIN if it already changed
  }
  words_->waiters.fetch_sub(1, std::memory_order_seq_cst);
}

void Doorbell::spin_wait(uint32_t seen, std::chrono::nanoseconds spin, std::chrono::nanoseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto spin_until = start + std::min(spin, timeout);
  auto now = start;
  while (now < spin_until) {
    if (words_->sequence.load(std::memory_order_seq_cst) != seen) return;
    // Yield rather than pause: on a busy CPU the thread we wait for may be the one that needs it.
    ::sched_yield();
    const auto before = now;
    now = Clock::now();
    // Another task ran meanwhile: the CPU is contended, so sleep and let ring() wake us (a woken thread is
    // scheduled promptly; a yielding one may wait out other tasks' whole time slices).
    if (now - before > kYieldGaveAwayCpu) break;
  }
  wait(seen, timeout - (now - start));
}

}  // namespace mapp
