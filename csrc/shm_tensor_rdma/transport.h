// One rank's endpoint: owns the receive side (this rank's segment + inbox), the send side (a channel per peer,
// attached by the connector) and the send workers. Validates every argument; errors are the types in errors.h.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "buffer_pool.h"
#include "inbox.h"
#include "message.h"
#include "peer_connector.h"
#include "remote_backend.h"
#include "send_request.h"
#include "shm_receiver.h"
#include "transport_options.h"
#include "wait_tick.h"
#include "worker_pool.h"

namespace mapp {


class Transport {
 public:
  explicit Transport(TransportOptions options);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Posts a send and returns at once; `data` must stay valid until the request is done. Returns nullptr when
  // the message was already copied into the peer's ring (small messages, ring not full).
  std::shared_ptr<SendRequest> send(int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                                    const void* data, uint64_t nbytes);
  // Waits for every send posted so far; rethrows the first failure not reported yet.
  void wait_sends(std::optional<double> timeout_s);
  // Keys of messages fully arrived and not yet taken, oldest first. Never blocks.
  std::vector<MessageKey> poll();
  std::optional<MessageHeader> peek(int peer, uint64_t tag);
  std::optional<Message> try_take(int peer, uint64_t tag);
  // Blocks until one of `keys` has arrived (without taking it). timeout nullopt means options.timeout_s.
  MessageKey wait_any(const std::vector<MessageKey>& keys, std::optional<double> timeout_s);
  Message recv(int peer, uint64_t tag, std::optional<double> timeout_s);
  // Cancels sends not completed yet (their requests fail with ClosedError), stops all threads, removes this
  // rank's name and any name of this job left by a dead process. Idempotent.
  void close();
  bool closed() const { return closing_.load(); }
  // Run by blocking calls about every kWaitTick; what it throws ends the wait.
  void set_interrupt_check(InterruptCheck check) { interrupt_check_ = std::move(check); }
  // Runs on every complete incoming message before it is published, whatever backend carried it (the loss layer).
  void set_arrival_filter(std::shared_ptr<ArrivalFilter> filter) { inbox_.set_arrival_filter(std::move(filter)); }
  const std::vector<int>& peers() const { return peers_; }
  // "shm", "tcp" or "rdma": how this rank reaches `peer`.
  std::string backend_of(int peer) const;
  // Where peers reach this rank over `backend` ("host:port"); throws std::invalid_argument if it serves no peer.
  std::string local_address(const std::string& backend) const;
  // Tells a remote backend where `peer` listens (from the address exchange through the torch.distributed store).
  void set_peer_address(int peer, const std::string& address);
  int rank() const { return options_.rank; }

  // Removes segments of `job_id` whose owner process is gone; returns their names.
  static std::vector<std::string> cleanup_job(const std::string& job_id);

 private:
  void check_usable();
  void validate_peer(int peer, const char* action) const;
  // Raises (once) every send failure not reported yet, as one exception.
  void report_pending_failure();
  static void raise_first_failure(const std::vector<std::shared_ptr<SendRequest>>& failed);
  // Queues `message` from byte `offset` on for the peer's send worker; returns its request.
  std::shared_ptr<SendRequest> post_send(int peer, const OutgoingMessage& message, uint64_t offset);
  void perform_send(const std::shared_ptr<SendRequest>& request, int peer, const OutgoingMessage& message,
                    uint64_t offset);
  // The doorbell every backend rings when a message arrives: the shm receiver's, or ours when no peer uses shm.
  Doorbell& arrivals() { return receiver_ ? receiver_->arrivals() : own_arrivals_; }
  void drain_shm(bool wait_for_lock = true) {
    if (receiver_) receiver_->drain_available(wait_for_lock);
  }
  void note_failure(const std::shared_ptr<SendRequest>& request);
  void track(const std::shared_ptr<SendRequest>& request);
  MessageKey wait_for_keys(const std::vector<MessageKey>& keys, std::optional<double> timeout_s);
  // Throws PeerDiedError / ClosedError if a peer named in `keys` can no longer send (after collecting everything
  // it sent); returns a key if that final collection completed one.
  std::optional<MessageKey> check_senders(const std::vector<MessageKey>& keys);

  const TransportOptions options_;
  const int creator_pid_;  // a forked child must neither use nor tear down its parent's transport
  InterruptCheck interrupt_check_;
  const std::vector<int> peers_;
  std::vector<bool> is_peer_;
  std::shared_ptr<BufferPool> pool_;
  Inbox inbox_;
  std::unique_ptr<ShmReceiver> receiver_;
  std::unique_ptr<PeerConnector> connector_;
  DoorbellWords own_arrival_words_;
  Doorbell own_arrivals_{&own_arrival_words_};
  std::vector<std::unique_ptr<RemoteBackend>> remote_backends_;
  std::vector<RemoteBackend*> remote_of_;  // per rank: its remote backend, nullptr for shm
  std::unique_ptr<WorkerPool> workers_;
  std::atomic<bool> closing_{false};
  std::mutex close_mutex_;

  std::mutex requests_mutex_;
  std::vector<std::shared_ptr<SendRequest>> outstanding_;
  std::vector<std::shared_ptr<SendRequest>> failures_;
};

}  // namespace mapp
