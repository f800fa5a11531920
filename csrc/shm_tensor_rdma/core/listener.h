// Where a remote backend (tcp, rdma) accepts its peers' connections: listens at once, tells peers a reachable
// "host:port", and runs one accept thread. Each new connection first proves the job's secret (admission.h): the
// thread keeps every unproven connection non-blocking with its own deadline, so silent or slow strangers cost real
// peers nothing; a proven one goes to the backend's admit function (which reads and checks the peer's hello).
// Running out of file descriptors (EMFILE/ENFILE) pauses accepting for a moment, reported once.
// stop() wakes the thread through an eventfd and joins it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "tcp_socket.h"
#include "unique_fd.h"

namespace mapp {

class Listener {
 public:
  using Admit = std::function<void(TcpSocket)>;

  // Listens on host:port (port 0: any free port). Throws std::runtime_error naming the address ("port in use").
  // Admits connections that prove `secret` for `job_id`.
  Listener(const std::string& host, int port, std::string secret, std::string job_id);
  ~Listener();  // stop()
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Starts the accept thread; `admit` runs on it, one connection at a time.
  void start(Admit admit);
  // Ends the accept thread (an admit in progress finishes first). Idempotent.
  void stop();
  // What peers are told: the listen host, or this machine's hostname when listening on every interface.
  std::string address() const;
  // Connections dropped before admission: wrong or missing proof, silence past the deadline, garbage.
  uint64_t strangers_dropped() const { return strangers_dropped_.load(); }

 private:
  void accept_loop();

  TcpSocket socket_;
  std::string advertised_host_;
  int port_ = 0;
  EventFd stop_;
  const std::string secret_;
  const std::string job_id_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> strangers_dropped_{0};
  Admit admit_;
  std::thread thread_;
};

}  // namespace mapp
