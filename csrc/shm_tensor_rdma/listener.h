// Where a remote backend (tcp, rdma) accepts its peers' connections: listens at once, tells peers a reachable
// "host:port", and runs one accept thread that hands each new connection to the backend's admit function (which
// reads and checks the peer's hello). stop() wakes the thread through an eventfd and joins it.
#pragma once

#include <atomic>
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
  Listener(const std::string& host, int port);
  ~Listener();  // stop()
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Starts the accept thread; `admit` runs on it, one connection at a time.
  void start(Admit admit);
  // Ends the accept thread (an admit in progress finishes first). Idempotent.
  void stop();
  // What peers are told: the listen host, or this machine's hostname when listening on every interface.
  std::string address() const;

 private:
  void accept_loop();

  TcpSocket socket_;
  std::string advertised_host_;
  int port_ = 0;
  EventFd stop_;
  std::atomic<bool> stopping_{false};
  Admit admit_;
  std::thread thread_;
};

}  // namespace mapp
