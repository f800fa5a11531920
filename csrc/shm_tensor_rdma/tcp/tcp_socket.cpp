#include "tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <thread>

#include "errors.h"
#include "host_port.h"
#include "wait_tick.h"

namespace mapp {
namespace {

constexpr int kListenBacklog = 128;
constexpr auto kConnectRetry = std::chrono::milliseconds(100);

struct AddrInfoList {
  addrinfo* head = nullptr;
  ~AddrInfoList() {
    if (head) ::freeaddrinfo(head);
  }
};

AddrInfoList resolve(const std::string& host, int port, bool passive) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  AddrInfoList list;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list.head);
  if (rc != 0) {
    throw std::runtime_error("cannot resolve '" + format_host_port(host, port) + "': " + ::gai_strerror(rc));
  }
  return list;
}

void set_int_option(int fd, int level, int name, int value) {
  ::setsockopt(fd, level, name, &value, sizeof(value));  // best effort: tuning only
}

}  // namespace

void TcpSocket::shutdown_both() const {
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

TcpSocket tcp_listen(const std::string& host, int port) {
  AddrInfoList list = resolve(host, port, /*passive=*/true);
  int last_error = 0;
  for (addrinfo* info = list.head; info != nullptr; info = info->ai_next) {
    TcpSocket socket(::socket(info->ai_family, info->ai_socktype | SOCK_CLOEXEC, info->ai_protocol));
    if (!socket.valid()) {
      last_error = errno;
      continue;
    }
    set_int_option(socket.fd(), SOL_SOCKET, SO_REUSEADDR, 1);
    if (::bind(socket.fd(), info->ai_addr, info->ai_addrlen) != 0 || ::listen(socket.fd(), kListenBacklog) != 0) {
      last_error = errno;
      continue;
    }
    return socket;
  }
  throw std::runtime_error(system_error_text("cannot listen on " + format_host_port(host, port), last_error));
}

int tcp_bound_port(const TcpSocket& socket) {
  sockaddr_storage address;
  socklen_t length = sizeof(address);
  if (::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw std::runtime_error(system_error_text("getsockname", errno));
  }
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

TcpSocket tcp_connect(const std::string& host, int port, std::chrono::steady_clock::time_point deadline,
                      const std::atomic<bool>& stopping) {
  const std::string where = format_host_port(host, port);
  int last_error = 0;
  for (;;) {
    if (stopping.load()) throw ClosedError("transport closed while connecting to " + where);
    AddrInfoList list = resolve(host, port, /*passive=*/false);
    for (addrinfo* info = list.head; info != nullptr; info = info->ai_next) {
      TcpSocket socket(::socket(info->ai_family, info->ai_socktype | SOCK_CLOEXEC, info->ai_protocol));
      if (!socket.valid()) {
        last_error = errno;
        continue;
      }
      if (::connect(socket.fd(), info->ai_addr, info->ai_addrlen) == 0) return socket;
      last_error = errno;
    }
    // Refused / unreachable: the peer may not listen yet. Anything else is retried the same way, bounded.
    if (std::chrono::steady_clock::now() + kConnectRetry >= deadline) {
      throw TimeoutError(system_error_text("could not connect to " + where, last_error));
    }
    std::this_thread::sleep_for(kConnectRetry);
  }
}

void tcp_tune(const TcpSocket& socket) {
  const int fd = socket.fd();
  set_int_option(fd, IPPROTO_TCP, TCP_NODELAY, 1);
  set_int_option(fd, SOL_SOCKET, SO_KEEPALIVE, 1);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPIDLE, 5);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPINTVL, 2);
  set_int_option(fd, IPPROTO_TCP, TCP_KEEPCNT, 4);
  set_int_option(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, 30000);  // ms of unacknowledged data before the kernel gives up
}

void tcp_set_receive_timeout(int fd, int seconds) {
  timeval limit{seconds, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
}

size_t tcp_read_full(int fd, void* data, size_t size) {
  auto* bytes = static_cast<uint8_t*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t got = ::recv(fd, bytes + done, size - done, MSG_WAITALL);
    if (got > 0) {
      done += static_cast<size_t>(got);
    } else if (got == 0) {
      return done;
    } else if (errno != EINTR) {
      throw std::runtime_error(std::strerror(errno));
    }
  }
  return done;
}

void skip_written(struct iovec*& iov, int& count, size_t bytes) {
  while (count > 0 && bytes >= iov->iov_len) {
    bytes -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0) {
    iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + bytes;
    iov->iov_len -= bytes;
  }
}

size_t tcp_write_now(int fd, struct iovec* iov, int count) {
  msghdr message;
  std::memset(&message, 0, sizeof(message));
  message.msg_iov = iov;
  message.msg_iovlen = static_cast<size_t>(count);
  ssize_t sent;
  do {
    sent = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (sent < 0 && errno == EINTR);
  return sent > 0 ? static_cast<size_t>(sent) : 0;
}

TcpWriteResult tcp_write_all(int fd, struct iovec* iov, int count, const std::atomic<bool>& stopping,
                             double idle_timeout_s) {
  auto give_up_at = deadline_after(idle_timeout_s);
  while (count > 0) {
    if (stopping.load()) return {TcpWriteStatus::kStopped, 0};
    msghdr message;
    std::memset(&message, 0, sizeof(message));
    message.msg_iov = iov;
    message.msg_iovlen = static_cast<size_t>(count);
    const ssize_t sent = ::sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sent > 0) {
      skip_written(iov, count, static_cast<size_t>(sent));
      give_up_at = deadline_after(idle_timeout_s);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return {TcpWriteStatus::kBroken, errno};
    const auto now = std::chrono::steady_clock::now();
    if (now >= give_up_at) return {TcpWriteStatus::kTimedOut, 0};
    // Socket full: sleep until it drains, a tick at most so `stopping` is seen promptly.
    pollfd waiting{fd, POLLOUT, 0};
    const auto wait = std::min<std::chrono::steady_clock::duration>(give_up_at - now, kWaitTick);
    const int wait_ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(wait).count()) + 1;
    if (::poll(&waiting, 1, wait_ms) < 0 && errno != EINTR) return {TcpWriteStatus::kBroken, errno};
  }
  return {TcpWriteStatus::kDone, 0};
}

}  // namespace mapp
