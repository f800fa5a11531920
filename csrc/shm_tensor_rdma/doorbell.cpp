#include "doorbell.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace mapp {
namespace {

// Not FUTEX_PRIVATE: the word may be shared between processes.
long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

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

}  // namespace mapp
