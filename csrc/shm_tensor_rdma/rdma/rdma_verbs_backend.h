// The RDMA backend: RC queue pairs, one per direction and peer, set up by an exchange of endpoint info over a TCP
// bootstrap connection (rdma_wire.h) that then stays open as the link's lifeline.
//
// Sending (the transport's worker for that peer): the first send connects; each message is cut into chunks
// (rdma_chunk.h), each chunk copied into a registered staging slot and RDMA-written with immediate into the
// receiver's slot of the same index, as soon as the credit window (rdma_flow.h) says that slot is free. send()
// returns once the last chunk is posted (the caller's tensor is no longer needed).
// Receiving: one progress thread sleeps in poll() on the completion channel, the async-event fd and every
// bootstrap socket. A data completion copies the chunk out of its slot (the assembler), publishes finished
// messages with Inbox::put, re-posts the receive and returns credits in batches by SEND WITH IMMEDIATE.
// Failure: an error completion, a fatal async event, or the bootstrap socket closing without a goodbye marks the
// link failed with the peer named (PeerDiedError); a goodbye marks it closed (ClosedError).
// Compiled only with rdma-core (MAPP_HAVE_IBVERBS).
#pragma once

#ifdef MAPP_HAVE_IBVERBS

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "address_book.h"
#include "listener.h"
#include "rdma_chunk.h"
#include "rdma_device.h"
#include "rdma_flow.h"
#include "rdma_queue_pair.h"
#include "rdma_settings.h"
#include "backend.h"
#include "tcp_socket.h"
#include "unique_fd.h"

namespace mapp {

class RdmaBackend : public Backend {
 public:
  // Opens the device and listens for bootstrap connections on context.listen_host (any free port). Throws
  // std::invalid_argument when no device is usable, std::runtime_error when a resource cannot be had.
  RdmaBackend(BackendContext context, const RdmaSettings& settings);
  ~RdmaBackend() override;  // close()

  const char* name() const override { return "rdma"; }
  std::string local_address() const override { return listener_.address(); }
  uint64_t strangers_dropped() const override { return listener_.strangers_dropped(); }
  void set_peer_address(int peer, const std::string& address) override;
  // `offset` is always 0: this backend never sends inline.
  void send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) override;
  std::optional<PeerFailure> failure(int peer) override;
  void close() override;

 private:
  // Which link a completion queue belongs to (its CQ context).
  struct LinkId {
    int peer;
    bool outbound;
  };
  // Destruction order matters: queue pair, then completion queue, then registered memory.
  struct SendLink {
    LinkId id;
    TcpSocket bootstrap;
    bool watching = false;  // the progress thread polls the bootstrap socket
    std::unique_ptr<RdmaMemory> staging;
    std::unique_ptr<RdmaCompletionQueue> cq;
    std::unique_ptr<RdmaQueuePair> qp;
    RdmaEndpointInfo remote;
    std::unique_ptr<RdmaSendWindow> window;
    uint64_t next_message_index = 0;
    std::optional<PeerFailure> broken;
  };
  struct ReceiveLink {
    LinkId id;
    TcpSocket bootstrap;
    bool watching = false;
    std::unique_ptr<RdmaMemory> ring;
    std::unique_ptr<RdmaCompletionQueue> cq;
    std::unique_ptr<RdmaQueuePair> qp;
    uint64_t slot_bytes = 0;
    std::unique_ptr<RdmaSlotReleases> releases;
    std::unique_ptr<RdmaCreditReturn> credits;
    std::unique_ptr<RdmaMessageAssembler> assembler;
    std::optional<PeerFailure> failure;
  };

  void admit(TcpSocket socket);
  void connect(int peer, SendLink& link, const OutgoingMessage& message, const SendLimits& limits);
  uint64_t wait_for_slot(SendLink& link, const SendLimits& limits, const std::string& what);
  [[noreturn]] static void throw_broken(const PeerFailure& broken, const std::string& while_text);
  void say_goodbye(TcpSocket& bootstrap);

  void progress_loop();
  void wake_progress();
  void on_completion_events();
  void drain(ibv_cq* cq, LinkId id);
  void on_send_side_completion(SendLink& link, const ibv_wc& wc);
  void on_receive_side_completion(ReceiveLink& link, const ibv_wc& wc);
  void return_credits(ReceiveLink& link, bool idle);
  void on_async_events();
  void on_bootstrap_readable(LinkId id);
  void mark_send_broken(SendLink& link, bool died, const std::string& text);
  void set_failure(ReceiveLink& link, bool died, const std::string& text);

  const BackendContext context_;
  const RdmaSettings settings_;
  std::unique_ptr<RdmaDevice> device_;  // outlives every link (declared before the link maps)
  AddressBook addresses_;
  Listener listener_;
  EventFd progress_stop_;  // ends the progress thread (after the goodbyes, which need it)
  EventFd progress_wake_;  // a link was added: re-read the set of sockets to watch
  std::atomic<bool> stopping_{false};

  mutable std::mutex mutex_;
  std::condition_variable changed_;  // a credit, a completion or a failure arrived
  std::map<int, SendLink> outbound_;  // keys fixed at construction
  std::map<int, ReceiveLink> inbound_;
  bool closed_ = false;

  std::thread progress_thread_;
};

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
