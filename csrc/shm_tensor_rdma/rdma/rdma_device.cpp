#include "rdma_device.h"

#ifdef MAPP_HAVE_IBVERBS

#include <fcntl.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "errors.h"

namespace mapp {
namespace {

// Owns the array ibv_get_device_list returns.
struct DeviceList {
  ibv_device** devices = nullptr;
  int count = 0;
  DeviceList() { devices = ::ibv_get_device_list(&count); }
  ~DeviceList() {
    if (devices) ::ibv_free_device_list(devices);
  }
};

uint8_t link_layer_code(uint8_t verbs_link_layer) {
  return verbs_link_layer == IBV_LINK_LAYER_ETHERNET ? kLinkLayerEthernet : kLinkLayerInfiniband;
}

std::vector<RdmaGidEntry> port_gids(ibv_context* context, uint8_t port, int table_length) {
  std::vector<RdmaGidEntry> gids;
  for (int index = 0; index < table_length; ++index) {
    ibv_gid_entry entry;
    if (::ibv_query_gid_ex(context, port, static_cast<uint32_t>(index), &entry, 0) != 0) continue;  // empty slot
    RdmaGidEntry summary{entry.gid_index, static_cast<GidType>(entry.gid_type), {}};
    std::memcpy(summary.gid.data(), entry.gid.raw, summary.gid.size());
    gids.push_back(summary);
  }
  return gids;
}

void set_nonblocking(int fd, const char* what) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw std::runtime_error(system_error_text(std::string("fcntl(") + what + ")", errno));
  }
}

}  // namespace

std::string verbs_error_text(const std::string& what, int errnum) {
  return system_error_text(what, errnum == 0 ? EIO : errnum);
}

std::vector<RdmaPortSummary> list_rdma_ports() {
  std::vector<RdmaPortSummary> ports;
  DeviceList list;
  for (int d = 0; list.devices && d < list.count; ++d) {
    const std::string name = ::ibv_get_device_name(list.devices[d]);
    ibv_context* context = ::ibv_open_device(list.devices[d]);
    if (context == nullptr) continue;
    ibv_device_attr device_attr;
    if (::ibv_query_device(context, &device_attr) == 0) {
      for (uint8_t port = 1; port <= device_attr.phys_port_cnt; ++port) {
        ibv_port_attr port_attr;
        if (::ibv_query_port(context, port, &port_attr) != 0) continue;
        ports.push_back(RdmaPortSummary{name, port, port_attr.state == IBV_PORT_ACTIVE,
                                        link_layer_code(port_attr.link_layer),
                                        port_gids(context, port, port_attr.gid_tbl_len)});
      }
    }
    ::ibv_close_device(context);
  }
  return ports;
}

RdmaDevice::RdmaDevice(const RdmaSettings& settings) {
  const std::vector<RdmaPortSummary> ports = list_rdma_ports();
  const RdmaPortSummary* chosen = nullptr;
  try {
    chosen = &choose_rdma_port(ports, settings);
    gid_index_ = choose_gid_index(*chosen, settings.gid_index);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(std::string("no usable RDMA device: ") + error.what());
  }
  port_ = static_cast<uint8_t>(chosen->port);
  DeviceList list;
  for (int d = 0; list.devices && d < list.count && context_ == nullptr; ++d) {
    if (chosen->device == ::ibv_get_device_name(list.devices[d])) context_ = ::ibv_open_device(list.devices[d]);
  }
  if (context_ == nullptr) throw std::runtime_error(verbs_error_text("ibv_open_device(" + chosen->device + ")", errno));
  try {
    ibv_port_attr port_attr;
    if (::ibv_query_port(context_, port_, &port_attr) != 0) throw std::runtime_error(verbs_error_text("ibv_query_port", errno));
    link_layer_ = link_layer_code(port_attr.link_layer);
    active_mtu_ = port_attr.active_mtu;
    lid_ = port_attr.lid;
    if (gid_index_ >= 0) {
      ibv_gid gid;
      if (::ibv_query_gid(context_, port_, gid_index_, &gid) != 0) throw std::runtime_error(verbs_error_text("ibv_query_gid", errno));
      std::memcpy(gid_.data(), gid.raw, gid_.size());
    }
    pd_ = ::ibv_alloc_pd(context_);
    if (pd_ == nullptr) throw std::runtime_error(verbs_error_text("ibv_alloc_pd", errno));
    channel_ = ::ibv_create_comp_channel(context_);
    if (channel_ == nullptr) throw std::runtime_error(verbs_error_text("ibv_create_comp_channel", errno));
    // The progress thread sleeps in poll() on these and then drains them without blocking.
    set_nonblocking(channel_->fd, "completion channel");
    set_nonblocking(context_->async_fd, "async event fd");
  } catch (...) {
    release();
    throw;
  }
  description_ = describe_port(*chosen) + (gid_index_ >= 0 ? " GID index " + std::to_string(gid_index_) : "");
}

RdmaDevice::~RdmaDevice() { release(); }

void RdmaDevice::release() {
  if (channel_) ::ibv_destroy_comp_channel(channel_);
  if (pd_) ::ibv_dealloc_pd(pd_);
  if (context_) ::ibv_close_device(context_);
  channel_ = nullptr;
  pd_ = nullptr;
  context_ = nullptr;
}

RdmaMemory::RdmaMemory(ibv_pd* pd, size_t bytes, int access) : size_(bytes) {
  void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (address == MAP_FAILED) throw std::runtime_error(system_error_text("mmap of " + std::to_string(bytes) + " bytes", errno));
  data_ = static_cast<uint8_t*>(address);
  mr_ = ::ibv_reg_mr(pd, data_, bytes, access);
  if (mr_ == nullptr) {
    const int error = errno;
    ::munmap(data_, size_);
    throw std::runtime_error(verbs_error_text("ibv_reg_mr of " + std::to_string(bytes) + " bytes (is the locked-memory "
                                              "limit, ulimit -l, too low?)", error));
  }
}

RdmaMemory::~RdmaMemory() {
  if (mr_) ::ibv_dereg_mr(mr_);
  if (data_) ::munmap(data_, size_);
}

RdmaCompletionQueue::RdmaCompletionQueue(const RdmaDevice& device, int depth, void* owner) {
  cq_ = ::ibv_create_cq(device.context(), depth, owner, device.channel(), 0);
  if (cq_ == nullptr) throw std::runtime_error(verbs_error_text("ibv_create_cq", errno));
  try {
    arm();
  } catch (...) {
    ::ibv_destroy_cq(cq_);
    throw;
  }
}

RdmaCompletionQueue::~RdmaCompletionQueue() {
  if (cq_) ::ibv_destroy_cq(cq_);
}

void RdmaCompletionQueue::arm() {
  const int rc = ::ibv_req_notify_cq(cq_, 0);
  if (rc != 0) throw std::runtime_error(verbs_error_text("ibv_req_notify_cq", rc));
}

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
