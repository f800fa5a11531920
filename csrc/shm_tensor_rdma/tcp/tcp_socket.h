// Socket plumbing for the TCP backend: an owning fd, listen/connect, and whole-buffer reads and writes.
// Writes never block without bound: they sleep in poll() a tick at a time, re-checking `stopping` and the
// no-progress timeout. Reads block in the kernel (the receive thread has nothing else to do); close() wakes them
// with shutdown().
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

#include "unique_fd.h"

namespace mapp {

class TcpSocket {
 public:
  TcpSocket() = default;
  explicit TcpSocket(int fd) : fd_(fd) {}

  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  // Wakes every thread blocked on this socket (reads return 0, writes fail); the fd stays open.
  void shutdown_both() const;

 private:
  UniqueFd fd_;
};

// Listens on host:port (port 0: any free port). Throws std::runtime_error naming the address ("port in use").
TcpSocket tcp_listen(const std::string& host, int port);
int tcp_bound_port(const TcpSocket& socket);

// Connects to host:port, retrying refused/unreachable attempts until `deadline` or `stopping`.
// Throws TimeoutError (with the last error) or ClosedError.
TcpSocket tcp_connect(const std::string& host, int port, std::chrono::steady_clock::time_point deadline,
                      const std::atomic<bool>& stopping);

// No Nagle, keepalive probes that notice a vanished host within ~15 s, a user timeout for stuck writes.
void tcp_tune(const TcpSocket& socket);

// Reads on `fd` give up (EAGAIN) after `seconds` without data; 0: never. Bounds the wait for a peer's hello.
void tcp_set_receive_timeout(int fd, int seconds);

// Reads exactly `size` bytes unless the stream ends first; returns the bytes read (size, or less at EOF).
// Throws std::runtime_error with the errno text (e.g. "Connection reset by peer").
size_t tcp_read_full(int fd, void* data, size_t size);

// Result of a vectored write that could not finish.
enum class TcpWriteStatus { kDone, kStopped, kTimedOut, kBroken };
struct TcpWriteResult {
  TcpWriteStatus status;
  int error;  // errno when kBroken
};
// Writes all of iov[0..count) (modifies the array), sleeping in poll() while the socket is full. Gives up when
// `stopping` becomes true or nothing could be written for `idle_timeout_s`.
TcpWriteResult tcp_write_all(int fd, struct iovec* iov, int count, const std::atomic<bool>& stopping,
                             double idle_timeout_s);

// Advances `iov` / `count` past `bytes` already written (a partial sendmsg); the last entry is trimmed in place.
void skip_written(struct iovec*& iov, int& count, size_t bytes);

// One non-blocking sendmsg of the whole array: the bytes it took, 0 if none (socket full or broken: a blocking
// tcp_write_all then waits or reports why).
size_t tcp_write_now(int fd, struct iovec* iov, int count);

}  // namespace mapp
