#include "rdma_queue_pair.h"

#ifdef MAPP_HAVE_IBVERBS

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>

#include "peer_name.h"

namespace mapp {
namespace {

// RC retry: 4.096 us * 2**14 = 67 ms per attempt, 7 attempts: a vanished peer fails a write within about 0.5 s.
constexpr uint8_t kAckTimeout = 14;
constexpr uint8_t kRetryCount = 7;
constexpr uint8_t kRnrRetryInfinite = 7;  // receives are always posted ahead; never give up on "receiver not ready"
constexpr uint8_t kMinRnrTimer = 12;      // 0.64 ms
constexpr uint8_t kHopLimit = 64;

uint32_t random_psn() {
  std::random_device seed;
  return seed() & 0xFFFFFFu;
}

}  // namespace

RdmaQueuePair::RdmaQueuePair(const RdmaDevice& device, ibv_cq* cq, uint32_t send_depth, uint32_t recv_depth)
    : device_(device), psn_(random_psn()) {
  ibv_qp_init_attr init;
  std::memset(&init, 0, sizeof(init));
  init.send_cq = cq;
  init.recv_cq = cq;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 1;  // every work request completes visibly: completions drive the credit and staging logic
  init.cap.max_send_wr = send_depth;
  init.cap.max_recv_wr = recv_depth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_ = ::ibv_create_qp(device.pd(), &init);
  if (qp_ == nullptr) throw std::runtime_error(verbs_error_text("ibv_create_qp", errno));
  try {
    ibv_qp_attr attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = device.port();
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    modify(attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, QpState::kInit, "INIT");
  } catch (...) {
    ::ibv_destroy_qp(qp_);
    throw;
  }
}

RdmaQueuePair::~RdmaQueuePair() {
  if (qp_) ::ibv_destroy_qp(qp_);
}

QpState RdmaQueuePair::state() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return state_.state();
}

void RdmaQueuePair::modify(ibv_qp_attr& attr, int mask, QpState to, const char* what) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (!QpStateMachine::allowed(state_.state(), to)) state_.advance(to);  // throws the clear logic_error
  const int rc = ::ibv_modify_qp(qp_, &attr, mask);
  if (rc != 0) throw std::runtime_error(verbs_error_text(std::string("ibv_modify_qp to ") + what, rc));
  state_.advance(to);
}

void RdmaQueuePair::describe_local(RdmaEndpointInfo& info) const {
  info.qp_num = qp_->qp_num;
  info.psn = psn_;
  info.lid = device_.lid();
  info.mtu = static_cast<uint8_t>(device_.active_mtu());
  info.link_layer = device_.link_layer();
  info.gid = device_.gid();
}

void RdmaQueuePair::connect(const RdmaEndpointInfo& remote) {
  if (remote.link_layer != device_.link_layer()) {
    throw std::runtime_error(peer_name(remote.rank) + " uses " +
                             (remote.link_layer == kLinkLayerEthernet ? "RoCE" : "InfiniBand") + ", this rank " +
                             (device_.link_layer() == kLinkLayerEthernet ? "RoCE" : "InfiniBand"));
  }
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = static_cast<ibv_mtu>(std::min<int>(remote.mtu, device_.active_mtu()));
  attr.dest_qp_num = remote.qp_num;
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = kMinRnrTimer;
  attr.ah_attr.port_num = device_.port();
  attr.ah_attr.dlid = remote.lid;
  if (device_.gid_index() >= 0) {  // RoCE (or an explicitly chosen GID on InfiniBand): route by GRH
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.data(), remote.gid.size());
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_.gid_index());
    attr.ah_attr.grh.hop_limit = kHopLimit;
  }
  modify(attr,
         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
             IBV_QP_MIN_RNR_TIMER,
         QpState::kReadyToReceive, "RTR");
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = kAckTimeout;
  attr.retry_cnt = kRetryCount;
  attr.rnr_retry = kRnrRetryInfinite;
  attr.sq_psn = psn_;
  attr.max_rd_atomic = 1;
  modify(attr,
         IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
         QpState::kReadyToSend, "RTS");
}

void RdmaQueuePair::fail() {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (!QpStateMachine::allowed(state_.state(), QpState::kError)) return;
  ibv_qp_attr attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.qp_state = IBV_QPS_ERR;
  (void)::ibv_modify_qp(qp_, &attr, IBV_QP_STATE);  // best effort: the queue pair is being abandoned
  state_.advance(QpState::kError);
}

void RdmaQueuePair::post_receive(uint64_t wr_id) {
  ibv_recv_wr wr;
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  ibv_recv_wr* bad = nullptr;
  const int rc = ::ibv_post_recv(qp_, &wr, &bad);
  if (rc != 0) throw std::runtime_error(verbs_error_text("ibv_post_recv", rc));
}

void RdmaQueuePair::post_write_with_immediate(uint64_t wr_id, const RdmaMemory& local, size_t offset, size_t length,
                                              uint64_t remote_address, uint32_t rkey, uint32_t immediate) {
  ibv_sge sge;
  sge.addr = reinterpret_cast<uintptr_t>(local.data() + offset);
  sge.length = static_cast<uint32_t>(length);
  sge.lkey = local.lkey();
  ibv_send_wr wr;
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(immediate);
  wr.wr.rdma.remote_addr = remote_address;
  wr.wr.rdma.rkey = rkey;
  ibv_send_wr* bad = nullptr;
  const int rc = ::ibv_post_send(qp_, &wr, &bad);
  if (rc != 0) throw std::runtime_error(verbs_error_text("ibv_post_send (rdma write)", rc));
}

void RdmaQueuePair::post_send_immediate(uint64_t wr_id, uint32_t immediate) {
  ibv_send_wr wr;
  std::memset(&wr, 0, sizeof(wr));
  wr.wr_id = wr_id;
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(immediate);
  ibv_send_wr* bad = nullptr;
  const int rc = ::ibv_post_send(qp_, &wr, &bad);
  if (rc != 0) throw std::runtime_error(verbs_error_text("ibv_post_send (credit)", rc));
}

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
