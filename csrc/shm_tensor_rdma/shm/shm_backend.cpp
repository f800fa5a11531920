#include "shm_backend.h"

#include <stdexcept>

#include "peer_name.h"

namespace mapp {
namespace {

// Producers wake the waiting thread itself (not the drain thread) while it exists.
class ShmForegroundWait : public Backend::ForegroundWait {
 public:
  explicit ShmForegroundWait(ShmReceiver& receiver) : wait_(receiver) {}

 private:
  ShmReceiver::ForegroundWait wait_;
};

}  // namespace

ShmBackend::ShmBackend(const BackendContext& context)
    : rank_(context.rank),
      receiver_(std::make_unique<ShmReceiver>(
          ReceiverConfig{context.job_id, context.rank, context.world_size, context.peers, context.slot_bytes,
                         context.num_slots, context.max_message_bytes},
          context.inbox, context.pool)),
      connector_(std::make_unique<PeerConnector>(context.job_id, context.rank, context.world_size, context.peers)) {}

ShmBackend::~ShmBackend() { close(); }

std::string ShmBackend::local_address() const {
  throw std::invalid_argument("rank " + std::to_string(rank_) +
                              " needs no address for shm peers (they find its segment by job id)");
}

void ShmBackend::set_peer_address(int peer, const std::string&) {
  throw std::invalid_argument(peer_name(peer) + " is reached through shared memory");
}

bool ShmBackend::send_now(int peer, const OutgoingMessage& message, uint64_t* offset, uint64_t until) {
  ShmChannel* channel = connector_->channel_if_ready(peer);
  return channel != nullptr && channel->send_now(message, offset, until);
}

void ShmBackend::send(int peer, const OutgoingMessage& message, const SendLimits& limits, uint64_t offset) {
  ShmChannel& channel = connector_->wait_channel(peer, message.header.tag, limits.timeout_s, *limits.stopping);
  channel.send(message, limits, offset);
}

SlotLease ShmBackend::reserve_slot(int peer, const OutgoingMessage& message, uint64_t offset,
                                   const SendLimits& limits) {
  ShmChannel& channel = connector_->wait_channel(peer, message.header.tag, limits.timeout_s, *limits.stopping);
  return channel.reserve(message, offset, limits);
}

void ShmBackend::commit_slot(int peer) {
  ShmChannel* channel = connector_->channel_if_ready(peer);
  if (channel == nullptr) throw std::logic_error("commit_slot before any slot of " + peer_name(peer) + " was leased");
  channel->commit();
}

SlotRegion ShmBackend::slot_region(int peer, const SendLimits& limits, uint64_t tag) {
  return connector_->wait_channel(peer, tag, limits.timeout_s, *limits.stopping).slot_region();
}

std::unique_ptr<Backend::ForegroundWait> ShmBackend::foreground_wait() {
  return std::make_unique<ShmForegroundWait>(*receiver_);
}

std::optional<PeerFailure> ShmBackend::failure(int peer) {
  if (std::optional<std::string> corruption = receiver_->corruption(peer)) return PeerFailure{true, *corruption};
  std::optional<ProcessIdentity> identity = connector_->owner_of(peer);
  if (!identity) identity = receiver_->producer(peer);
  const bool closed = receiver_->producer_closed(peer) || connector_->peer_closed(peer);
  const bool died = !closed && identity && !identity->alive();
  if (!died && !closed) return std::nullopt;
  // Whatever the peer published before it went away is still ours to collect.
  receiver_->drain_available();
  if (died) return PeerFailure{true, peer_name(peer) + " (pid " + std::to_string(identity->pid) + ") died"};
  return PeerFailure{false, peer_name(peer) + " closed its transport"};
}

void ShmBackend::close() {
  connector_->stop();
  receiver_->close();
}

}  // namespace mapp
