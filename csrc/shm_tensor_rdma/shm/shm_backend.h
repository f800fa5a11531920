// The shared-memory backend: the receive side is this rank's segment (ShmReceiver), the send side a ring in
// each peer's segment (PeerConnector attaches the ShmChannels). Peers find each other by job id and rank, so
// no address is exchanged.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "backend.h"
#include "peer_connector.h"
#include "shm_receiver.h"

namespace mapp {

class ShmBackend : public Backend {
 public:
  // Creates and publishes this rank's segment, then starts attaching to the peers'. Throws std::runtime_error.
  explicit ShmBackend(const BackendContext& context);
  ~ShmBackend() override;  // close()

  const char* name() const override { return "shm"; }
  // Producers in other processes ring this doorbell (it lives in our segment).
  Doorbell* own_arrivals() override { return &receiver_->arrivals(); }
  std::string local_address() const override;
  void set_peer_address(int peer, const std::string& address) override;
  bool sends_inline() const override { return true; }
  bool send_now(int peer, const OutgoingMessage& message, uint64_t* offset, uint64_t until) override;
  void send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) override;
  SlotLease reserve_slot(int peer, const OutgoingMessage& message, uint64_t offset,
                         const SendLimits& limits) override;
  void commit_slot(int peer) override;
  SlotRegion slot_region(int peer, const SendLimits& limits, uint64_t tag) override;
  bool claim_receive(int peer, uint64_t tag) override { return receiver_->claim(peer, tag); }
  std::optional<ReceivedChunk> next_claimed_chunk(int peer) override { return receiver_->next_claimed(peer); }
  bool release_claimed_chunk(int peer) override { return receiver_->release_claimed(peer); }
  void cancel_claim(int peer) override { receiver_->cancel_claim(peer); }
  SlotRegion receive_region(int peer) override { return receiver_->receive_region(peer); }
  void collect_arrivals(bool wait_for_lock) override { receiver_->drain_available(wait_for_lock); }
  std::unique_ptr<ForegroundWait> foreground_wait() override;
  std::optional<PeerFailure> failure(int peer) override;
  void wake_senders() override { connector_->wake_senders(); }
  void close() override;

 private:
  const int rank_;
  std::unique_ptr<ShmReceiver> receiver_;
  std::unique_ptr<PeerConnector> connector_;
};

}  // namespace mapp
