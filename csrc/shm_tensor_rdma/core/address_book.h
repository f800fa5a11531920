// Where a remote backend's peers listen, and how a sender reaches one: the addresses arrive from the rendezvous
// (set), a send waits for its peer's (bounded by its timeout), then connects. Shared by tcp and rdma. Thread-safe.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "host_port.h"
#include "outgoing_message.h"
#include "tcp_socket.h"

namespace mapp {

class AddressBook {
 public:
  // `backend` names the backend in errors ("rank 2 is not a tcp peer of rank 0").
  AddressBook(std::string backend, int my_rank, const std::vector<int>& peers);

  // Throws std::invalid_argument for bad "host:port" text or a rank this backend does not serve.
  void set(int peer, const std::string& address);
  // "peer rank 3 (10.0.0.2:41234)", or "peer rank 3" before its address is known.
  std::string describe(int peer) const;

  struct Connection {
    TcpSocket socket;  // connected and tuned
    HostPort address;
  };
  // Waits for `peer`'s address, then connects (retrying while it does not listen yet), all within
  // limits.timeout_s. `tag` names the message waiting in errors. Throws ClosedError (the transport or this book
  // closed), TimeoutError (no address, or no connection, in time).
  Connection connect(int peer, uint64_t tag, const SendLimits& limits);
  // Wakes senders waiting for an address; they throw ClosedError. Idempotent.
  void close();

 private:
  const std::string backend_;
  const int my_rank_;
  mutable std::mutex mutex_;
  std::condition_variable address_known_;
  std::map<int, std::optional<HostPort>> addresses_;  // keys fixed at construction
  bool closed_ = false;
};

}  // namespace mapp
