// The interface of a backend that reaches peers on other hosts (tcp, rdma), as the Transport sees it.
// Sends: the transport calls send() on its worker thread for that peer (one at a time per peer, in order).
// Receives: the backend's own threads publish each complete message with Inbox::put (the one place every backend
// publishes, so a hook there sees all traffic) and then ring the arrivals doorbell.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "doorbell.h"
#include "inbox.h"
#include "shm_channel.h"  // OutgoingMessage, SendLimits

namespace mapp {

// Why a peer can no longer send to us: it died (connection lost) or closed its transport cleanly.
struct PeerFailure {
  bool died;
  std::string text;  // "peer rank 3 (10.0.0.2:41234): connection reset by peer"
};

// What every remote backend gets from the transport.
struct RemoteContext {
  int rank;
  std::string job_id;
  std::vector<int> peers;  // the peers this backend serves, both directions
  uint64_t max_message_bytes;
  Inbox* inbox;
  Doorbell* arrivals;
  std::shared_ptr<BufferPool> pool;
};

class RemoteBackend {
 public:
  virtual ~RemoteBackend() = default;
  virtual const char* name() const = 0;
  // What a peer needs to reach us ("host:port" for tcp); published through the torch.distributed store.
  virtual std::string local_address() const = 0;
  // Where `peer` listens. Sends to a peer wait (bounded by their timeout) until its address is known.
  virtual void set_peer_address(int peer, const std::string& address) = 0;
  // Blocks until the whole message is handed to the network. Throws PeerDiedError, ClosedError, TimeoutError.
  virtual void send(int peer, const OutgoingMessage& message, const SendLimits& limits) = 0;
  // Set once `peer` can send nothing more (everything it sent before is already in the inbox).
  virtual std::optional<PeerFailure> failure(int peer) const = 0;
  // Called after the send workers stopped: says goodbye to peers, stops and joins the backend's threads.
  virtual void close() = 0;
};

}  // namespace mapp
