#include "tcp_backend.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "errors.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {
namespace {

constexpr int kHelloTimeoutS = 10;      // an accepted connection must name itself this fast
constexpr double kGoodbyeTimeoutS = 1;  // close() does not wait longer for a peer that stopped reading

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

std::string local_hostname() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

void set_receive_timeout(int fd, int seconds) {
  timeval limit{seconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
}

}  // namespace

TcpBackend::TcpBackend(RemoteContext context, const std::string& listen_host, int listen_port)
    : context_(std::move(context)) {
  listener_ = tcp_listen(listen_host, listen_port);
  port_ = tcp_bound_port(listener_);
  advertised_host_ = is_wildcard(listen_host) ? local_hostname() : listen_host;
  for (int peer : context_.peers) {
    inbound_[peer];
    outbound_[peer];
  }
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd_ < 0) throw std::runtime_error(system_error_text("eventfd", errno));
  accept_thread_ = std::thread([this] { accept_loop(); });
}

TcpBackend::~TcpBackend() {
  close();
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

std::string TcpBackend::describe_peer(int peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return describe_remote_peer(peer, outbound_.at(peer).address);
}

void TcpBackend::set_peer_address(int peer, const std::string& address) {
  const HostPort parsed = parse_host_port(address);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = outbound_.find(peer);
    if (found == outbound_.end()) {
      throw std::invalid_argument("rank " + std::to_string(peer) + " is not a tcp peer of rank " +
                                  std::to_string(context_.rank));
    }
    found->second.address = parsed;
  }
  address_known_.notify_all();
}

void TcpBackend::accept_loop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{listener_.fd(), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (stopping_.load() || (fds[1].revents & POLLIN)) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // the connecting side retries; transient errors (ECONNABORTED, EMFILE) are its problem
    admit(TcpSocket(fd));
  }
}

void TcpBackend::admit(TcpSocket socket) {
  tcp_tune(socket);
  set_receive_timeout(socket.fd(), kHelloTimeoutS);
  TcpHello hello;
  size_t got = 0;
  try {
    got = tcp_read_full(socket.fd(), &hello, sizeof(hello));
  } catch (const std::exception&) {
    return;  // a stranger or a dead connector: drop it
  }
  if (got != sizeof(hello) || !check_tcp_hello(hello, context_.job_id, context_.peers).empty()) return;
  set_receive_timeout(socket.fd(), 0);
  const int peer = hello.rank;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  Inbound& link = inbound_.at(peer);
  if (link.socket.valid()) {
    // Two processes claim the same rank: the job is misconfigured; say so rather than mixing their streams.
    if (!link.failure) {
      link.failure = PeerFailure{true, "a second connection claims to be peer rank " + std::to_string(peer) +
                                           " (is that rank started twice?)"};
    }
    context_.arrivals->ring();
    return;
  }
  link.socket = std::move(socket);
  const int fd = link.socket.fd();
  link.thread = std::thread([this, peer, fd] { receive_loop(peer, fd); });
}

void TcpBackend::set_failure(int peer, bool died, const std::string& text) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Inbound& link = inbound_.at(peer);
    if (!link.failure) link.failure = PeerFailure{died, text};
  }
  context_.arrivals->ring();
}

void TcpBackend::receive_loop(int peer, int fd) {
  const std::string who = "peer rank " + std::to_string(peer);
  try {
    for (;;) {
      TcpFrameHeader frame;
      const size_t got = tcp_read_full(fd, &frame, sizeof(frame));
      if (stopping_.load()) return;
      if (got == 0) {
        set_failure(peer, true, who + " closed its connection without a goodbye (its process exited or was killed)");
        return;
      }
      if (got != sizeof(frame)) {
        set_failure(peer, true, who + "'s connection ended inside a frame header");
        return;
      }
      const std::string problem = check_tcp_frame(frame, context_.max_message_bytes);
      if (!problem.empty()) {
        set_failure(peer, true, who + " sent a bad frame: " + problem);
        return;
      }
      if (frame.kind == static_cast<uint32_t>(TcpFrameKind::kBye)) {
        set_failure(peer, false, who + " closed its transport");
        return;
      }
      PooledBuffer payload = context_.pool->acquire(frame.message.nbytes);
      const size_t body = tcp_read_full(fd, payload.data(), frame.message.nbytes);
      if (stopping_.load()) return;
      if (body != frame.message.nbytes) {
        set_failure(peer, true, who + "'s connection ended inside " + describe_tag(frame.message.tag) + " (" +
                                    std::to_string(body) + " of " + std::to_string(frame.message.nbytes) +
                                    " bytes arrived)");
        return;
      }
      context_.inbox->put(peer, Message{frame.message, std::move(payload)});
      context_.arrivals->ring();
    }
  } catch (const std::exception& error) {
    if (!stopping_.load()) set_failure(peer, true, who + ": connection lost (" + error.what() + ")");
  }
}

void TcpBackend::connect(int peer, Outbound& link, const OutgoingMessage& message, const SendLimits& limits) {
  const auto deadline = deadline_after(limits.timeout_s);
  std::optional<HostPort> address;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!link.address) {
      if (limits.stopping->load() || stopping_.load()) {
        throw ClosedError("transport closed before " + describe_tag(message.header.tag) + " to peer rank " +
                          std::to_string(peer) + " was sent");
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        throw TimeoutError("rank " + std::to_string(limits.my_rank) + " never learned the address of peer rank " +
                           std::to_string(peer) + " (waited " + format_seconds(limits.timeout_s) + " to send " +
                           describe_tag(message.header.tag) + ")");
      }
      address_known_.wait_for(lock, kWaitTick);
    }
    address = link.address;
  }
  TcpSocket socket;
  try {
    socket = tcp_connect(address->host, address->port, deadline, *limits.stopping);
  } catch (const TimeoutError& error) {
    throw TimeoutError("rank " + std::to_string(limits.my_rank) + " cannot reach peer rank " +
                       std::to_string(peer) + ": " + error.what());
  }
  tcp_tune(socket);
  TcpHello hello = make_tcp_hello(limits.my_rank, context_.job_id);
  iovec iov{&hello, sizeof(hello)};
  const TcpWriteResult result = tcp_write_all(socket.fd(), &iov, 1, *limits.stopping, limits.timeout_s);
  if (result.status != TcpWriteStatus::kDone) {
    throw PeerDiedError("peer rank " + std::to_string(peer) + " (" +
                        format_host_port(address->host, address->port) + ") dropped the connection of rank " +
                        std::to_string(limits.my_rank) + " at once");
  }
  link.socket = std::move(socket);
}

void TcpBackend::send(int peer, const OutgoingMessage& message, const SendLimits& limits) {
  auto found = outbound_.find(peer);
  if (found == outbound_.end()) {
    throw std::invalid_argument("rank " + std::to_string(peer) + " is not a tcp peer of rank " +
                                std::to_string(context_.rank));
  }
  Outbound& link = found->second;
  // Error text only: formatting it for every message would cost the hot path a few allocations.
  auto what = [&] { return describe_tag(message.header.tag) + " to peer rank " + std::to_string(peer); };
  if (link.broken) throw PeerDiedError(*link.broken);
  if (!link.socket.valid()) {
    // A peer whose own connection to us already failed cannot take messages either: fail now, not at timeout.
    if (std::optional<PeerFailure> gone = failure(peer)) {
      const std::string text = gone->text + " before rank " + std::to_string(limits.my_rank) + " sent " +
                               describe_tag(message.header.tag);
      if (gone->died) throw PeerDiedError(text);
      throw ClosedError(text);
    }
    connect(peer, link, message, limits);
  }

  TcpFrameHeader frame = make_tcp_data_frame(message.header);
  iovec iov[2] = {{&frame, sizeof(frame)},
                  {const_cast<uint8_t*>(message.data), static_cast<size_t>(message.header.nbytes)}};
  const int count = message.header.nbytes > 0 ? 2 : 1;
  const TcpWriteResult result = tcp_write_all(link.socket.fd(), iov, count, *limits.stopping, limits.timeout_s);
  switch (result.status) {
    case TcpWriteStatus::kDone:
      return;
    case TcpWriteStatus::kStopped:
      link.broken = "transport of rank " + std::to_string(limits.my_rank) + " closed during a send";
      throw ClosedError("transport closed before " + what() + " was sent");
    case TcpWriteStatus::kTimedOut:
      link.broken = describe_peer(peer) + " stopped reading";
      throw TimeoutError("rank " + std::to_string(limits.my_rank) + " made no progress for " +
                         format_seconds(limits.timeout_s) + " sending " + what() + " (it stopped reading)");
    case TcpWriteStatus::kBroken: {
      std::optional<PeerFailure> inbound = failure(peer);
      if (inbound && !inbound->died) {
        link.broken = inbound->text;
        throw ClosedError(inbound->text + " while rank " + std::to_string(limits.my_rank) + " sent " +
                          describe_tag(message.header.tag));
      }
      link.broken = describe_peer(peer) + ": connection lost (" + std::strerror(result.error) + ")";
      throw PeerDiedError(*link.broken + " while rank " + std::to_string(limits.my_rank) + " sent " +
                          describe_tag(message.header.tag));
    }
  }
}

std::optional<PeerFailure> TcpBackend::failure(int peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = inbound_.find(peer);
  if (found == inbound_.end()) return std::nullopt;
  return found->second.failure;
}

void TcpBackend::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
  }
  stopping_.store(true);
  address_known_.notify_all();
  const uint64_t one = 1;
  if (stop_fd_ >= 0) (void)!::write(stop_fd_, &one, sizeof(one));
  if (accept_thread_.joinable()) accept_thread_.join();
  // Goodbye on every intact outbound stream, so peers waiting on us get ClosedError, not PeerDied.
  const std::atomic<bool> never{false};
  for (auto& [peer, link] : outbound_) {
    if (!link.socket.valid()) continue;
    if (!link.broken) {
      TcpFrameHeader bye = make_tcp_bye_frame();
      iovec iov{&bye, sizeof(bye)};
      (void)tcp_write_all(link.socket.fd(), &iov, 1, never, kGoodbyeTimeoutS);
    }
    ::shutdown(link.socket.fd(), SHUT_WR);
  }
  for (auto& [peer, link] : inbound_) link.socket.shutdown_both();
  for (auto& [peer, link] : inbound_) {
    if (link.thread.joinable()) link.thread.join();
  }
}

}  // namespace mapp
