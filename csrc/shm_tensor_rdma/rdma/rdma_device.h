// The verbs resources of the RDMA backend, one RAII class each: the opened device and port (context, protection
// domain, completion channel), a registered buffer, a completion queue. Compiled only with rdma-core
// (MAPP_HAVE_IBVERBS); choosing the port and GID is rdma_settings.h's pure logic, fed from list_rdma_ports().
#pragma once

#ifdef MAPP_HAVE_IBVERBS

#include <infiniband/verbs.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "rdma_settings.h"

namespace mapp {

// Every port of every RDMA device on this host, with its GID table. Empty when there is none (also when the
// kernel has no RDMA support). Devices that cannot be opened or queried are left out.
std::vector<RdmaPortSummary> list_rdma_ports();

class RdmaDevice {
 public:
  // Opens the port that choose_rdma_port() picks. Throws std::invalid_argument "no usable RDMA device: ..." or
  // std::runtime_error naming the failed verbs call.
  explicit RdmaDevice(const RdmaSettings& settings);
  ~RdmaDevice();
  RdmaDevice(const RdmaDevice&) = delete;
  RdmaDevice& operator=(const RdmaDevice&) = delete;

  ibv_context* context() const { return context_; }
  ibv_pd* pd() const { return pd_; }
  ibv_comp_channel* channel() const { return channel_; }
  uint8_t port() const { return port_; }
  uint8_t link_layer() const { return link_layer_; }  // kLinkLayerInfiniband / kLinkLayerEthernet
  ibv_mtu active_mtu() const { return active_mtu_; }
  uint16_t lid() const { return lid_; }
  int gid_index() const { return gid_index_; }  // -1: none (InfiniBand, routed by LID)
  const std::array<uint8_t, 16>& gid() const { return gid_; }
  const std::string& description() const { return description_; }

 private:
  void release();  // frees what exists, newest first

  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  uint8_t port_ = 0;
  uint8_t link_layer_ = kLinkLayerInfiniband;
  ibv_mtu active_mtu_ = IBV_MTU_1024;
  uint16_t lid_ = 0;
  int gid_index_ = -1;
  std::array<uint8_t, 16> gid_{};
  std::string description_;
};

// A page-aligned buffer registered with the device's protection domain.
class RdmaMemory {
 public:
  // Throws std::runtime_error (with errno text) when allocation or registration fails.
  RdmaMemory(ibv_pd* pd, size_t bytes, int access);
  ~RdmaMemory();
  RdmaMemory(const RdmaMemory&) = delete;
  RdmaMemory& operator=(const RdmaMemory&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  ibv_mr* mr_ = nullptr;
};

// A completion queue that reports to the device's completion channel. `owner` comes back from
// ibv_get_cq_event as the CQ's context, so the waiting thread knows which link completed.
class RdmaCompletionQueue {
 public:
  RdmaCompletionQueue(const RdmaDevice& device, int depth, void* owner);
  ~RdmaCompletionQueue();  // every event of this CQ must have been acknowledged
  RdmaCompletionQueue(const RdmaCompletionQueue&) = delete;
  RdmaCompletionQueue& operator=(const RdmaCompletionQueue&) = delete;

  ibv_cq* get() const { return cq_; }
  // Asks for one event at the next completion. Throws std::runtime_error.
  void arm();

 private:
  ibv_cq* cq_ = nullptr;
};

std::string verbs_error_text(const std::string& what, int errnum);

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
