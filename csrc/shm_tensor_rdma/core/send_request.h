// Completion state of one posted send, shared by the caller's handle and the worker that performs it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <string>

#include "wait_tick.h"

namespace mapp {

class SendRequest {
 public:
  void complete();
  void fail(std::exception_ptr error);
  bool done() const;
  // Waits up to timeout_s (forever if nullopt); false on timeout. Throws only what `interrupt` throws.
  bool wait_done(std::optional<double> timeout_s, const InterruptCheck& interrupt = nullptr);
  // Waits, then rethrows the send's error (marking it reported). Throws TimeoutError naming `what` on timeout.
  void wait_or_throw(std::optional<double> timeout_s, const std::string& what,
                     const InterruptCheck& interrupt = nullptr);
  std::exception_ptr error() const;
  // True exactly once for a failed request: whoever gets true reports the failure to the user.
  bool claim_failure_report();

 private:
  mutable std::mutex mutex_;
  std::condition_variable finished_;
  bool done_ = false;
  std::exception_ptr error_;
  std::atomic<bool> reported_{false};
};

}  // namespace mapp
