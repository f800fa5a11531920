#include "rdma_verbs_backend.h"

#ifdef MAPP_HAVE_IBVERBS

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "admission.h"
#include "errors.h"
#include "peer_name.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {
namespace {

constexpr int kHelloTimeoutS = 10;      // each side of the set-up must answer this fast
constexpr double kGoodbyeTimeoutS = 1;  // close() does not wait longer for writes still in flight
constexpr uint32_t kSpareWorkRequests = 4;
constexpr int kCompletionsPerPoll = 32;

// What a work request was, kept in its 64-bit id next to a sequence number.
enum class WorkKind : uint64_t { kDataWrite = 1, kCreditReceive = 2, kDataReceive = 3, kCreditSend = 4 };
constexpr int kWorkKindShift = 56;

uint64_t work_id(WorkKind kind, uint64_t index) {
  return (static_cast<uint64_t>(kind) << kWorkKindShift) | (index & ((uint64_t{1} << kWorkKindShift) - 1));
}
WorkKind kind_of(uint64_t wr_id) { return static_cast<WorkKind>(wr_id >> kWorkKindShift); }

// Reads one endpoint info within the socket's receive timeout; nullopt if the stream ended or timed out first.
std::optional<std::vector<uint8_t>> read_endpoint_bytes(int fd) {
  std::vector<uint8_t> bytes(rdma_endpoint_info_bytes());
  try {
    if (tcp_read_full(fd, bytes.data(), bytes.size()) != bytes.size()) return std::nullopt;
  } catch (const std::runtime_error&) {
    return std::nullopt;  // timeout (EAGAIN) or reset
  }
  return bytes;
}

const char* status_text(ibv_wc_status status) { return ::ibv_wc_status_str(status); }

}  // namespace

RdmaBackend::RdmaBackend(BackendContext context, const RdmaSettings& settings)
    : context_(std::move(context)),
      settings_(settings),
      device_(std::make_unique<RdmaDevice>(settings)),
      addresses_("rdma", context_.rank, context_.peers),
      listener_(context_.listen_host, 0, context_.admission_secret, context_.job_id) {
  for (int peer : context_.peers) {
    outbound_[peer].id = LinkId{peer, true};
    inbound_[peer].id = LinkId{peer, false};
  }
  progress_thread_ = std::thread([this] { progress_loop(); });
  listener_.start([this](TcpSocket socket) { admit(std::move(socket)); });
}

RdmaBackend::~RdmaBackend() { close(); }

void RdmaBackend::set_peer_address(int peer, const std::string& address) { addresses_.set(peer, address); }

std::optional<PeerFailure> RdmaBackend::failure(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = inbound_.find(peer);
  if (found == inbound_.end()) return std::nullopt;
  return found->second.failure;
}

// ---- set-up: the receiving side ------------------------------------------------------------------------------

void RdmaBackend::admit(TcpSocket socket) {
  tcp_tune(socket);
  tcp_set_receive_timeout(socket.fd(), kHelloTimeoutS);
  const std::optional<std::vector<uint8_t>> bytes = read_endpoint_bytes(socket.fd());
  if (!bytes) return;  // a stranger or a dead connector: drop it
  RdmaEndpointInfo sender;
  try {
    sender = decode_endpoint_info(*bytes);
  } catch (const std::invalid_argument&) {
    return;
  }
  if (!check_endpoint_peer(sender, RdmaRole::kSender, context_.job_id, context_.peers).empty()) return;
  const int peer = sender.rank;
  ReceiveLink& link = inbound_.at(peer);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    if (link.qp || link.failure) {
      // Two processes claim the same rank: the job is misconfigured; say so rather than mixing their streams.
      if (!link.failure) {
        set_failure(link, true, "a second connection claims to be " + peer_name(peer) +
                                    " (is that rank started twice?)");
      }
      return;
    }
  }
  const std::string who = peer_name(peer);
  try {
    const uint32_t slots = std::min(settings_.slot_count, sender.slot_count);
    const uint64_t slot_bytes = settings_.slot_bytes;
    auto ring = std::make_unique<RdmaMemory>(device_->pd(), slots * slot_bytes,
                                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    auto cq = std::make_unique<RdmaCompletionQueue>(*device_, static_cast<int>(2 * (slots + kSpareWorkRequests)),
                                                    &link.id);
    auto qp = std::make_unique<RdmaQueuePair>(*device_, cq->get(), slots + kSpareWorkRequests,
                                              slots + kSpareWorkRequests);
    // Receives go up before the queue pair can accept writes; each data write consumes one.
    for (uint32_t i = 0; i < slots; ++i) qp->post_receive(work_id(WorkKind::kDataReceive, i));
    qp->connect(sender);

    RdmaEndpointInfo mine;
    mine.role = RdmaRole::kReceiver;
    mine.rank = context_.rank;
    mine.job_id = context_.job_id;
    qp->describe_local(mine);
    mine.ring_address = reinterpret_cast<uintptr_t>(ring->data());
    mine.ring_rkey = ring->rkey();
    mine.slot_count = slots;
    mine.slot_bytes = slot_bytes;
    std::vector<uint8_t> reply = encode_endpoint_info(mine);
    {
      // Installed before the reply goes out: the sender may write the moment it has it.
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return;
      link.slot_bytes = slot_bytes;
      link.releases = std::make_unique<RdmaSlotReleases>(slots);
      link.credits = std::make_unique<RdmaCreditReturn>(std::max<uint32_t>(1, slots / 4), slots);
      link.assembler = std::make_unique<RdmaMessageAssembler>(context_.pool, slot_bytes, context_.max_message_bytes);
      link.ring = std::move(ring);
      link.cq = std::move(cq);
      link.qp = std::move(qp);
    }
    const std::atomic<bool> never{false};
    iovec iov{reply.data(), reply.size()};
    if (tcp_write_all(socket.fd(), &iov, 1, never, kHelloTimeoutS).status != TcpWriteStatus::kDone) {
      std::lock_guard<std::mutex> lock(mutex_);
      set_failure(link, true, who + " dropped its rdma connection during set-up");
      return;
    }
  } catch (const std::exception& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    set_failure(link, true, "the rdma link from " + who + " could not be set up: " + error.what());
    return;
  }
  tcp_set_receive_timeout(socket.fd(), 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    link.bootstrap = std::move(socket);
    link.watching = true;
  }
  wake_progress();
}

// ---- set-up and sending: the sending side --------------------------------------------------------------------

void RdmaBackend::connect(int peer, SendLink& link, const OutgoingMessage& message, const SendLimits& limits) {
  AddressBook::Connection connection = addresses_.connect(peer, message.header.tag, limits);
  TcpSocket socket = std::move(connection.socket);
  const std::string who = peer_name(peer, connection.address);
  try {
    answer_admission(socket.fd(), context_.admission_secret, context_.job_id, limits.timeout_s);
  } catch (const std::exception& error) {
    throw PeerDiedError(who + " did not admit the rdma connection of rank " + std::to_string(limits.my_rank) + ": " +
                        error.what());
  }
  const uint32_t depth = settings_.slot_count + kSpareWorkRequests;
  auto cq = std::make_unique<RdmaCompletionQueue>(*device_, static_cast<int>(2 * depth), &link.id);
  auto qp = std::make_unique<RdmaQueuePair>(*device_, cq->get(), depth, depth);
  // One receive per credit message that can be in flight: the receiver sends at most one per ring slot.
  for (uint32_t i = 0; i < settings_.slot_count; ++i) qp->post_receive(work_id(WorkKind::kCreditReceive, i));

  RdmaEndpointInfo mine;
  mine.role = RdmaRole::kSender;
  mine.rank = limits.my_rank;
  mine.job_id = context_.job_id;
  qp->describe_local(mine);
  mine.slot_count = settings_.slot_count;
  std::vector<uint8_t> hello = encode_endpoint_info(mine);
  iovec iov{hello.data(), hello.size()};
  if (tcp_write_all(socket.fd(), &iov, 1, *limits.stopping, limits.timeout_s).status != TcpWriteStatus::kDone) {
    throw PeerDiedError(who + " dropped the rdma connection of rank " + std::to_string(limits.my_rank) + " at once");
  }
  tcp_set_receive_timeout(socket.fd(), kHelloTimeoutS);
  const std::optional<std::vector<uint8_t>> bytes = read_endpoint_bytes(socket.fd());
  if (!bytes) {
    throw PeerDiedError(who + " did not answer the rdma connection set-up of rank " + std::to_string(limits.my_rank) +
                        " within " + std::to_string(kHelloTimeoutS) + " s (it rejected us, or could not set up its end)");
  }
  RdmaEndpointInfo receiver;
  try {
    receiver = decode_endpoint_info(*bytes);
    const std::string problem = check_endpoint_peer(receiver, RdmaRole::kReceiver, context_.job_id, {peer});
    if (!problem.empty()) throw std::invalid_argument(problem);
    if (receiver.slot_count > settings_.slot_count) {
      throw std::invalid_argument("it offers " + std::to_string(receiver.slot_count) + " slots, more than the " +
                                  std::to_string(settings_.slot_count) + " asked for");
    }
    (void)rdma_slot_payload_bytes(receiver.slot_bytes);
  } catch (const std::invalid_argument& error) {
    throw std::runtime_error(who + " answered the rdma set-up wrongly: " + error.what());
  }
  qp->connect(receiver);
  auto staging = std::make_unique<RdmaMemory>(device_->pd(), receiver.slot_count * receiver.slot_bytes,
                                              IBV_ACCESS_LOCAL_WRITE);
  tcp_set_receive_timeout(socket.fd(), 0);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    link.remote = receiver;
    link.window = std::make_unique<RdmaSendWindow>(receiver.slot_count);
    link.staging = std::move(staging);
    link.cq = std::move(cq);
    link.qp = std::move(qp);
    link.bootstrap = std::move(socket);
    link.watching = true;
  }
  wake_progress();
}

void RdmaBackend::throw_broken(const PeerFailure& broken, const std::string& while_text) {
  if (broken.died) throw PeerDiedError(broken.text + while_text);
  throw ClosedError(broken.text + while_text);
}

uint64_t RdmaBackend::wait_for_slot(SendLink& link, const SendLimits& limits, const std::string& what) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto give_up_at = deadline_after(limits.timeout_s);
  uint64_t credited = link.window->credited();
  for (;;) {
    if (link.broken) throw_broken(*link.broken, " while rank " + std::to_string(limits.my_rank) + " sent " + what);
    if (limits.stopping->load() || stopping_.load()) throw ClosedError("transport closed before " + what + " was sent");
    if (link.window->can_claim()) return link.window->claim();
    const auto now = std::chrono::steady_clock::now();
    if (link.window->credited() != credited) {  // the receiver is making progress: the timeout restarts
      credited = link.window->credited();
      give_up_at = deadline_after(limits.timeout_s);
    } else if (now >= give_up_at) {
      // Part of a message may be in the receiver's slots already: the link cannot carry another one.
      link.broken = PeerFailure{true, addresses_.describe(link.id.peer) + " stopped reading"};
      throw TimeoutError("rank " + std::to_string(limits.my_rank) + " made no progress for " +
                         format_seconds(limits.timeout_s) + " sending " + what + " (it stopped reading)");
    }
    changed_.wait_for(lock, kWaitTick);
  }
}

void RdmaBackend::send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t) {
  auto found = outbound_.find(peer);
  if (found == outbound_.end()) {
    throw std::invalid_argument("rank " + std::to_string(peer) + " is not an rdma peer of rank " +
                                std::to_string(context_.rank));
  }
  SendLink& link = found->second;  // only this peer's worker uses it, one send at a time
  const std::string what = describe_tag(message.header.tag) + " to " + peer_name(peer);
  bool connected = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (link.broken) throw_broken(*link.broken, " before rank " + std::to_string(limits.my_rank) + " sent " + what);
    connected = link.qp != nullptr;
  }
  if (!connected) {
    // A peer whose own link to us already failed cannot take messages either: fail now, not at a timeout.
    if (std::optional<PeerFailure> gone = failure(peer)) {
      throw_broken(*gone, " before rank " + std::to_string(limits.my_rank) + " sent " + describe_tag(message.header.tag));
    }
    connect(peer, link, message, limits);
  }
  const RdmaChunker chunker(message.header, message.data, link.remote.slot_bytes, link.next_message_index++);
  for (uint64_t chunk = 0; chunk < chunker.count(); ++chunk) {
    const uint64_t sequence = wait_for_slot(link, limits, what);
    const size_t offset = static_cast<size_t>(link.window->slot_of(sequence)) * link.remote.slot_bytes;
    const size_t length = chunker.write(chunk, sequence, link.staging->data() + offset);
    try {
      link.qp->post_write_with_immediate(work_id(WorkKind::kDataWrite, sequence), *link.staging, offset, length,
                                         link.remote.ring_address + offset, link.remote.ring_rkey,
                                         static_cast<uint32_t>(sequence));
    } catch (const std::runtime_error& error) {
      std::lock_guard<std::mutex> lock(mutex_);
      mark_send_broken(link, true, addresses_.describe(peer) + ": " + error.what());
      throw_broken(*link.broken, " while rank " + std::to_string(limits.my_rank) + " sent " + what);
    }
  }
}

// ---- the progress thread -------------------------------------------------------------------------------------

void RdmaBackend::wake_progress() { progress_wake_.signal(); }

void RdmaBackend::progress_loop() {
  std::vector<pollfd> fds;
  std::vector<LinkId> watched;
  for (;;) {
    fds = {{progress_stop_.fd(), POLLIN, 0},
           {progress_wake_.fd(), POLLIN, 0},
           {device_->channel()->fd, POLLIN, 0},
           {device_->context()->async_fd, POLLIN, 0}};
    watched.clear();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto watch = [&](bool watching, const TcpSocket& bootstrap, LinkId id) {
        if (!watching) return;
        fds.push_back({bootstrap.fd(), POLLIN, 0});
        watched.push_back(id);
      };
      for (const auto& [peer, link] : outbound_) watch(link.watching, link.bootstrap, link.id);
      for (const auto& [peer, link] : inbound_) watch(link.watching, link.bootstrap, link.id);
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents & POLLIN) return;
    if (fds[1].revents & POLLIN) progress_wake_.clear();
    if (fds[2].revents & POLLIN) on_completion_events();
    if (fds[3].revents & POLLIN) on_async_events();
    for (size_t i = 0; i < watched.size(); ++i) {
      if (fds[4 + i].revents & (POLLIN | POLLHUP | POLLERR)) on_bootstrap_readable(watched[i]);
    }
    // Everything that had arrived is handled: return every credit still owed, so no sender waits on a batch.
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [peer, link] : inbound_) return_credits(link, /*idle=*/true);
  }
}

void RdmaBackend::on_completion_events() {
  for (;;) {
    ibv_cq* cq = nullptr;
    void* owner = nullptr;
    if (::ibv_get_cq_event(device_->channel(), &cq, &owner) != 0) return;  // EAGAIN: no event left
    ::ibv_ack_cq_events(cq, 1);
    const LinkId id = *static_cast<const LinkId*>(owner);
    // Re-arm before draining: a completion that lands during the drain raises a new event instead of being missed.
    (void)::ibv_req_notify_cq(cq, 0);
    drain(cq, id);
  }
}

void RdmaBackend::drain(ibv_cq* cq, LinkId id) {
  ibv_wc completions[kCompletionsPerPoll];
  for (;;) {
    const int count = ::ibv_poll_cq(cq, kCompletionsPerPoll, completions);
    std::lock_guard<std::mutex> lock(mutex_);
    if (count < 0) {
      const std::string text = "polling the rdma completion queue of " + peer_name(id.peer) + " failed";
      if (id.outbound) mark_send_broken(outbound_.at(id.peer), true, text);
      else set_failure(inbound_.at(id.peer), true, text);
      return;
    }
    for (int i = 0; i < count; ++i) {
      if (id.outbound) on_send_side_completion(outbound_.at(id.peer), completions[i]);
      else on_receive_side_completion(inbound_.at(id.peer), completions[i]);
    }
    changed_.notify_all();
    if (count < kCompletionsPerPoll) return;
  }
}

void RdmaBackend::on_send_side_completion(SendLink& link, const ibv_wc& wc) {
  const WorkKind kind = kind_of(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    if (!(stopping_.load() && wc.status == IBV_WC_WR_FLUSH_ERR)) {
      mark_send_broken(link, true, addresses_.describe(link.id.peer) + ": rdma " +
                                       (kind == WorkKind::kDataWrite ? "write" : "credit receive") + " failed (" +
                                       status_text(wc.status) + ")");
    }
    link.qp->fail();
    return;
  }
  try {
    if (kind == WorkKind::kDataWrite) {
      link.window->on_write_completed();
    } else if (kind == WorkKind::kCreditReceive) {
      link.window->on_credit(ntohl(wc.imm_data));
      link.qp->post_receive(wc.wr_id);
    }
  } catch (const std::exception& error) {
    mark_send_broken(link, true, addresses_.describe(link.id.peer) + " broke the rdma protocol: " + error.what());
    link.qp->fail();
  }
}

void RdmaBackend::on_receive_side_completion(ReceiveLink& link, const ibv_wc& wc) {
  if (link.failure) return;  // leftovers (flushes) of a link that already failed
  const std::string who = peer_name(link.id.peer);
  const WorkKind kind = kind_of(wc.wr_id);
  if (wc.status != IBV_WC_SUCCESS) {
    if (!(stopping_.load() && wc.status == IBV_WC_WR_FLUSH_ERR)) {
      set_failure(link, true, "the rdma link from " + who + " failed (" + status_text(wc.status) + ")");
    }
    link.qp->fail();
    return;
  }
  try {
    if (kind == WorkKind::kCreditSend) {
      link.credits->on_send_completed();
      return;
    }
    if (kind != WorkKind::kDataReceive || wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM) {
      throw std::invalid_argument("unexpected completion (opcode " + std::to_string(wc.opcode) + ")");
    }
    const uint64_t sequence = link.releases->on_arrival(ntohl(wc.imm_data));
    const uint8_t* slot = link.ring->data() + static_cast<size_t>(link.releases->slot_of(sequence)) * link.slot_bytes;
    std::optional<Message> done = link.assembler->accept(slot, wc.byte_len, sequence);
    // The chunk is copied out: its slot may take the next one.
    link.releases->release(sequence);
    link.qp->post_receive(wc.wr_id);
    if (done) {
      context_.inbox->put(link.id.peer, std::move(*done));
      context_.arrivals->ring();
    }
    return_credits(link, /*idle=*/false);
  } catch (const std::exception& error) {
    set_failure(link, true, who + " broke the rdma protocol: " + error.what());
    link.qp->fail();
  }
}

void RdmaBackend::return_credits(ReceiveLink& link, bool idle) {
  if (link.failure || !link.qp) return;
  const std::optional<uint64_t> count = link.credits->due(link.releases->released_prefix(), idle);
  if (!count) return;
  try {
    link.qp->post_send_immediate(work_id(WorkKind::kCreditSend, *count), static_cast<uint32_t>(*count));
  } catch (const std::exception& error) {
    set_failure(link, true, "the rdma link from " + peer_name(link.id.peer) +
                                " cannot return credits: " + error.what());
    link.qp->fail();
  }
}

void RdmaBackend::on_async_events() {
  for (;;) {
    ibv_async_event event;
    if (::ibv_get_async_event(device_->context(), &event) != 0) return;  // EAGAIN: none left
    const char* what = ::ibv_event_type_str(event.event_type);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      switch (event.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR: {
          const uint32_t qp_num = event.element.qp->qp_num;
          for (auto& [peer, link] : outbound_) {
            if (link.qp && link.qp->qp_num() == qp_num) {
              mark_send_broken(link, true, addresses_.describe(peer) + ": rdma queue pair failed (" + what + ")");
            }
          }
          for (auto& [peer, link] : inbound_) {
            if (link.qp && link.qp->qp_num() == qp_num) {
              set_failure(link, true, "the rdma link from " + peer_name(peer) + " failed (" + what + ")");
            }
          }
          break;
        }
        case IBV_EVENT_PORT_ERR:
        case IBV_EVENT_DEVICE_FATAL:
        case IBV_EVENT_CQ_ERR: {
          const std::string text = "rdma device " + device_->description() + ": " + what;
          for (auto& [peer, link] : outbound_) {
            if (link.qp) mark_send_broken(link, true, text);
          }
          for (auto& [peer, link] : inbound_) {
            if (link.qp) set_failure(link, true, text + " (on the link from " + peer_name(peer) + ")");
          }
          break;
        }
        default:
          break;  // informational (port active, LID change, ...)
      }
    }
    ::ibv_ack_async_event(&event);
    changed_.notify_all();
  }
}

void RdmaBackend::on_bootstrap_readable(LinkId id) {
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fd = id.outbound ? outbound_.at(id.peer).bootstrap.fd() : inbound_.at(id.peer).bootstrap.fd();
  }
  uint8_t frame[kRdmaControlBytes];
  std::string problem;
  bool bye = false;
  try {
    const size_t got = tcp_read_full(fd, frame, sizeof(frame));
    if (got == sizeof(frame)) {
      bye = decode_control(frame, got) == RdmaControlKind::kBye;
    } else if (got > 0) {
      problem = "its rdma connection ended inside a control frame";
    }
  } catch (const std::exception& error) {
    problem = error.what();
  }
  if (stopping_.load()) return;  // our own close() shut the socket
  const std::string who = peer_name(id.peer);
  if (id.outbound) {
    std::lock_guard<std::mutex> lock(mutex_);
    SendLink& link = outbound_.at(id.peer);
    link.watching = false;
    if (bye) {
      mark_send_broken(link, false, who + " closed its transport");
    } else {
      mark_send_broken(link, true, addresses_.describe(id.peer) + " went away: its rdma connection closed " +
                                       (problem.empty() ? "without a goodbye" : "(" + problem + ")"));
    }
    return;
  }
  // Everything the peer wrote before it said goodbye (or died) has completed here: publish it first.
  ReceiveLink& link = inbound_.at(id.peer);
  drain(link.cq->get(), id);
  std::lock_guard<std::mutex> lock(mutex_);
  link.watching = false;
  if (bye) {
    set_failure(link, false, who + " closed its transport");
  } else {
    set_failure(link, true, who + (problem.empty()
                                       ? " closed its connection without a goodbye (its process exited or was killed)"
                                       : ": connection lost (" + problem + ")"));
  }
}

void RdmaBackend::mark_send_broken(SendLink& link, bool died, const std::string& text) {
  if (!link.broken) link.broken = PeerFailure{died, text};
  changed_.notify_all();
}

void RdmaBackend::set_failure(ReceiveLink& link, bool died, const std::string& text) {
  if (!link.failure) link.failure = PeerFailure{died, text};
  context_.arrivals->ring();
}

// ---- teardown ------------------------------------------------------------------------------------------------

void RdmaBackend::say_goodbye(TcpSocket& bootstrap) {
  const std::atomic<bool> never{false};
  const auto bye = encode_control(RdmaControlKind::kBye);
  iovec iov{const_cast<uint8_t*>(bye.data()), bye.size()};
  (void)tcp_write_all(bootstrap.fd(), &iov, 1, never, kGoodbyeTimeoutS);
  ::shutdown(bootstrap.fd(), SHUT_WR);
}

void RdmaBackend::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
  }
  addresses_.close();
  listener_.stop();
  // Goodbyes: on each outbound link once our last writes have landed (the progress thread still runs to see
  // them), so the peer publishes everything and then reports ClosedError rather than PeerDied; on each inbound
  // link so the peer's later sends fail as closed.
  for (auto& [peer, link] : outbound_) {
    bool intact = false;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!link.qp) continue;
      changed_.wait_until(lock, deadline_after(kGoodbyeTimeoutS),
                          [&] { return link.broken.has_value() || link.window->writes_done(); });
      intact = !link.broken.has_value();
    }
    if (intact) say_goodbye(link.bootstrap);
  }
  stopping_.store(true);
  changed_.notify_all();
  for (auto& [peer, link] : inbound_) {
    bool intact = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      intact = link.qp && !link.failure;
    }
    if (intact) say_goodbye(link.bootstrap);
  }
  progress_stop_.signal();
  if (progress_thread_.joinable()) progress_thread_.join();
  // Queue pairs to ERROR before they are destroyed with their completion queues and memory (in the maps).
  for (auto& [peer, link] : outbound_) {
    if (link.qp) link.qp->fail();
  }
  for (auto& [peer, link] : inbound_) {
    if (link.qp) link.qp->fail();
  }
}

}  // namespace mapp

#endif  // MAPP_HAVE_IBVERBS
