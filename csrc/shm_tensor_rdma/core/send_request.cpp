#include "send_request.h"

#include <chrono>

#include "errors.h"

namespace mapp {

void SendRequest::complete() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  finished_.notify_all();
}

void SendRequest::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);
    done_ = true;
  }
  finished_.notify_all();
}

bool SendRequest::done() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

bool SendRequest::wait_done(std::optional<double> timeout_s, const InterruptCheck& interrupt) {
  using Clock = std::chrono::steady_clock;
  const auto give_up_at =
      timeout_s ? deadline_after(*timeout_s) : Clock::time_point::max();
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    const auto now = Clock::now();
    if (done_) return true;
    if (now >= give_up_at) return false;
    const auto wake_at = (give_up_at - now > kWaitTick) ? now + kWaitTick : give_up_at;
    if (finished_.wait_until(lock, wake_at, [this] { return done_; })) return true;
    if (interrupt) {
      lock.unlock();
      interrupt();
      lock.lock();
    }
  }
}

void SendRequest::wait_or_throw(std::optional<double> timeout_s, const std::string& what,
                                const InterruptCheck& interrupt) {
  if (!wait_done(timeout_s, interrupt)) {
    throw TimeoutError(what + " did not complete within " + format_seconds(*timeout_s));
  }
  if (std::exception_ptr failure = error()) {
    reported_.store(true);
    std::rethrow_exception(failure);
  }
}

std::exception_ptr SendRequest::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

bool SendRequest::claim_failure_report() {
  if (!error()) return false;
  return !reported_.exchange(true);
}

}  // namespace mapp
