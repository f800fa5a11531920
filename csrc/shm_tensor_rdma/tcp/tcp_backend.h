// The TCP backend: one connection per direction and peer. This rank connects to each peer it sends to (lazily, on
// the first send) and accepts one connection from each peer that sends to it. Each inbound connection has a thread
// that reads frames in blocking calls and reads every payload straight into the buffer later handed to Python;
// sends are vectored writes from the caller's tensor (no staging copy): small ones on the caller's thread when the
// socket takes them at once, the rest on the transport's worker threads.
// A peer's death shows as EOF without a goodbye, a reset, or a keepalive timeout: it becomes PeerDiedError.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "address_book.h"
#include "listener.h"
#include "backend.h"
#include "tcp_frame.h"
#include "tcp_socket.h"

namespace mapp {

class TcpBackend : public Backend {
 public:
  // Listens on context.listen_host:listen_port (port 0: any free port) at once. Throws std::runtime_error if it
  // cannot.
  explicit TcpBackend(BackendContext context);
  ~TcpBackend() override;  // close()

  const char* name() const override { return "tcp"; }
  std::string local_address() const override { return listener_.address(); }
  uint64_t strangers_dropped() const override { return listener_.strangers_dropped(); }
  void set_peer_address(int peer, const std::string& address) override;
  // Small messages go out on the caller's thread when the connected link's socket takes the whole frame at once
  // (saves the hand-off to a worker); `offset` counts frame bytes written, header included.
  bool sends_inline() const override { return true; }
  bool send_now(int peer, const OutgoingMessage& message, uint64_t* offset, uint64_t until) override;
  void send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) override;
  std::optional<PeerFailure> failure(int peer) override;
  void close() override;

 private:
  struct Inbound {
    TcpSocket socket;
    std::thread thread;
    std::optional<PeerFailure> failure;
  };
  struct Outbound {
    TcpSocket socket;
    std::optional<std::string> broken;  // why the stream is unusable
  };

  void admit(TcpSocket socket);
  void receive_loop(int peer, int fd);
  void connect(int peer, Outbound& link, const OutgoingMessage& message, const SendLimits& limits);
  void set_failure(int peer, bool died, const std::string& text);

  const BackendContext context_;
  AddressBook addresses_;
  Listener listener_;
  std::atomic<bool> stopping_{false};

  mutable std::mutex mutex_;
  std::map<int, Inbound> inbound_;    // keys fixed at construction
  std::map<int, Outbound> outbound_;  // keys fixed at construction; a link's socket is used by one worker at a time
  bool closed_ = false;
};

}  // namespace mapp
