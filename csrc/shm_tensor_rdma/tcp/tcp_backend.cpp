#include "tcp_backend.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "admission.h"
#include "errors.h"
#include "peer_name.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {
namespace {

constexpr int kHelloTimeoutS = 10;      // an accepted connection must name itself this fast
constexpr double kGoodbyeTimeoutS = 1;  // close() does not wait longer for a peer that stopped reading

}  // namespace

TcpBackend::TcpBackend(BackendContext context)
    : context_(std::move(context)),
      addresses_("tcp", context_.rank, context_.peers),
      listener_(context_.listen_host, context_.listen_port, context_.admission_secret, context_.job_id) {
  for (int peer : context_.peers) {
    inbound_[peer];
    outbound_[peer];
  }
  listener_.start([this](TcpSocket socket) { admit(std::move(socket)); });
}

TcpBackend::~TcpBackend() { close(); }

void TcpBackend::set_peer_address(int peer, const std::string& address) { addresses_.set(peer, address); }

void TcpBackend::admit(TcpSocket socket) {
  tcp_tune(socket);
  tcp_set_receive_timeout(socket.fd(), kHelloTimeoutS);
  TcpHello hello;
  size_t got = 0;
  try {
    got = tcp_read_full(socket.fd(), &hello, sizeof(hello));
  } catch (const std::exception&) {
    return;  // a stranger or a dead connector: drop it
  }
  if (got != sizeof(hello) || !check_tcp_hello(hello, context_.job_id, context_.peers).empty()) return;
  tcp_set_receive_timeout(socket.fd(), 0);
  const int peer = hello.rank;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) return;
  Inbound& link = inbound_.at(peer);
  if (link.socket.valid()) {
    // Two processes claim the same rank: the job is misconfigured; say so rather than mixing their streams.
    if (!link.failure) {
      link.failure = PeerFailure{true, "a second connection claims to be " + peer_name(peer) +
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
  const std::string who = peer_name(peer);
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
  AddressBook::Connection connection = addresses_.connect(peer, message.header.tag, limits);
  try {
    answer_admission(connection.socket.fd(), context_.admission_secret, context_.job_id, limits.timeout_s);
  } catch (const std::exception& error) {
    throw PeerDiedError(peer_name(peer, connection.address) + " did not admit rank " +
                        std::to_string(limits.my_rank) + ": " + error.what());
  }
  TcpHello hello = make_tcp_hello(limits.my_rank, context_.job_id);
  iovec iov{&hello, sizeof(hello)};
  const TcpWriteResult result = tcp_write_all(connection.socket.fd(), &iov, 1, *limits.stopping, limits.timeout_s);
  if (result.status != TcpWriteStatus::kDone) {
    throw PeerDiedError(peer_name(peer, connection.address) + " dropped the connection of rank " +
                        std::to_string(limits.my_rank) + " at once");
  }
  link.socket = std::move(connection.socket);
}

bool TcpBackend::send_now(int peer, const OutgoingMessage& message, uint64_t* offset, uint64_t until) {
  if (*offset != 0 || message.header.nbytes > until) return false;
  auto found = outbound_.find(peer);
  // Not connected yet or broken: the worker connects, waits or reports.
  if (found == outbound_.end() || found->second.broken || !found->second.socket.valid()) return false;
  TcpFrameHeader frame = make_tcp_data_frame(message.header);
  iovec iov[2] = {{&frame, sizeof(frame)},
                  {const_cast<uint8_t*>(message.data), static_cast<size_t>(message.header.nbytes)}};
  const int count = message.header.nbytes > 0 ? 2 : 1;
  *offset = tcp_write_now(found->second.socket.fd(), iov, count);
  return *offset == sizeof(frame) + message.header.nbytes;
}

void TcpBackend::send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) {
  auto found = outbound_.find(peer);
  if (found == outbound_.end()) {
    throw std::invalid_argument("rank " + std::to_string(peer) + " is not a tcp peer of rank " +
                                std::to_string(context_.rank));
  }
  Outbound& link = found->second;
  // Error text only: formatting it for every message would cost the hot path a few allocations.
  auto what = [&] { return describe_tag(message.header.tag) + " to " + peer_name(peer); };
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
  int count = message.header.nbytes > 0 ? 2 : 1;
  iovec* unsent = iov;
  skip_written(unsent, count, offset);  // what send_now() already wrote
  const TcpWriteResult result = tcp_write_all(link.socket.fd(), unsent, count, *limits.stopping, limits.timeout_s);
  switch (result.status) {
    case TcpWriteStatus::kDone:
      return;
    case TcpWriteStatus::kStopped:
      link.broken = "transport of rank " + std::to_string(limits.my_rank) + " closed during a send";
      throw ClosedError("transport closed before " + what() + " was sent");
    case TcpWriteStatus::kTimedOut:
      link.broken = addresses_.describe(peer) + " stopped reading";
      throw TimeoutError("rank " + std::to_string(limits.my_rank) + " made no progress for " +
                         format_seconds(limits.timeout_s) + " sending " + what() + " (it stopped reading)");
    case TcpWriteStatus::kBroken: {
      std::optional<PeerFailure> inbound = failure(peer);
      if (inbound && !inbound->died) {
        link.broken = inbound->text;
        throw ClosedError(inbound->text + " while rank " + std::to_string(limits.my_rank) + " sent " +
                          describe_tag(message.header.tag));
      }
      link.broken = addresses_.describe(peer) + ": connection lost (" + std::strerror(result.error) + ")";
      throw PeerDiedError(*link.broken + " while rank " + std::to_string(limits.my_rank) + " sent " +
                          describe_tag(message.header.tag));
    }
  }
}

std::optional<PeerFailure> TcpBackend::failure(int peer) {
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
  addresses_.close();
  listener_.stop();
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
