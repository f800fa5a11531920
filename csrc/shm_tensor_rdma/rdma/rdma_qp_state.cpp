#include "rdma_qp_state.h"

#include <stdexcept>

namespace mapp {

const char* qp_state_name(QpState state) {
  switch (state) {
    case QpState::kReset: return "RESET";
    case QpState::kInit: return "INIT";
    case QpState::kReadyToReceive: return "RTR";
    case QpState::kReadyToSend: return "RTS";
    case QpState::kError: return "ERROR";
    case QpState::kClosed: return "CLOSED";
  }
  return "?";
}

bool QpStateMachine::allowed(QpState from, QpState to) {
  if (from == QpState::kClosed) return false;
  if (to == QpState::kClosed) return true;
  if (to == QpState::kError) return from != QpState::kError;
  return (from == QpState::kReset && to == QpState::kInit) ||
         (from == QpState::kInit && to == QpState::kReadyToReceive) ||
         (from == QpState::kReadyToReceive && to == QpState::kReadyToSend);
}

void QpStateMachine::advance(QpState to) {
  if (!allowed(state_, to)) {
    throw std::logic_error(std::string("illegal queue pair transition ") + qp_state_name(state_) + " -> " +
                           qp_state_name(to));
  }
  state_ = to;
}

}  // namespace mapp
