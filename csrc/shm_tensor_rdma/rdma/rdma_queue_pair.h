// One RC queue pair (RAII) and the verbs calls the backend makes on it. Every state change goes through
// QpStateMachine first. Compiled only with rdma-core (MAPP_HAVE_IBVERBS).
#pragma once

#ifdef MAPP_HAVE_IBVERBS

#include <infiniband/verbs.h>

#include <cstdint>
#include <mutex>

#include "rdma_device.h"
#include "rdma_qp_state.h"
#include "rdma_wire.h"

namespace mapp {

class RdmaQueuePair {
 public:
  // Creates the queue pair on `cq` (sends and receives) and moves it to INIT with remote-write access.
  // Throws std::runtime_error naming the failed verbs call.
  RdmaQueuePair(const RdmaDevice& device, ibv_cq* cq, uint32_t send_depth, uint32_t recv_depth);
  ~RdmaQueuePair();
  RdmaQueuePair(const RdmaQueuePair&) = delete;
  RdmaQueuePair& operator=(const RdmaQueuePair&) = delete;

  uint32_t qp_num() const { return qp_->qp_num; }
  // Our half of the bootstrap exchange (role, rank, job and ring fields are the caller's).
  void describe_local(RdmaEndpointInfo& info) const;
  // INIT -> RTR -> RTS towards `remote`.
  void connect(const RdmaEndpointInfo& remote);
  // Moves to ERROR (outstanding work requests complete as flushed). Harmless when already there or closed.
  void fail();
  QpState state() const;

  // A zero-length receive: consumed by a WRITE WITH IMMEDIATE or a SEND WITH IMMEDIATE from the peer.
  void post_receive(uint64_t wr_id);
  // Writes local[offset, offset+length) to remote_address (rkey) and delivers `immediate` to the peer's receive.
  void post_write_with_immediate(uint64_t wr_id, const RdmaMemory& local, size_t offset, size_t length,
                                 uint64_t remote_address, uint32_t rkey, uint32_t immediate);
  // A zero-length SEND WITH IMMEDIATE (credit return).
  void post_send_immediate(uint64_t wr_id, uint32_t immediate);

 private:
  void modify(ibv_qp_attr& attr, int mask, QpState to, const char* what);

  const RdmaDevice& device_;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_;
  mutable std::mutex state_mutex_;
  QpStateMachine state_;
};

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
