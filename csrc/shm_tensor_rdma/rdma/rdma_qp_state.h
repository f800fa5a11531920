// The life of one RDMA connection's queue pair (no verbs types: always compiled, unit-tested).
// RESET -> INIT -> RTR (ready to receive) -> RTS (ready to send) is the only way up; any live state may fall to
// ERROR (a failed work request, a fatal async event, teardown); every state may end in CLOSED, which is final.
// The verbs wrapper asks this machine before each ibv_modify_qp, so an out-of-order transition is a clear error
// here rather than an EINVAL from the driver.
#pragma once

#include <string>

namespace mapp {

enum class QpState { kReset, kInit, kReadyToReceive, kReadyToSend, kError, kClosed };

const char* qp_state_name(QpState state);  // "RESET", "INIT", "RTR", "RTS", "ERROR", "CLOSED"

class QpStateMachine {
 public:
  QpState state() const { return state_; }
  static bool allowed(QpState from, QpState to);
  // Throws std::logic_error "illegal queue pair transition RTS -> INIT" for a transition that is not allowed.
  void advance(QpState to);
  // Ready to carry traffic.
  bool ready() const { return state_ == QpState::kReadyToSend; }

 private:
  QpState state_ = QpState::kReset;
};

}  // namespace mapp
