#include "transport.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <stdexcept>
#include <string>

#include "backend_registry.h"
#include "errors.h"
#include "peer_name.h"
#include "tag.h"

namespace mapp {
namespace {

using Clock = std::chrono::steady_clock;

// The caller's thread copies a shared-memory message's first chunks itself, up to at least this many bytes, when
// its link is idle and the ring has room: smaller messages need no worker hand-off at all, and for larger ones
// the receiver starts copying out while the worker is still waking up for the rest.
constexpr uint64_t kInlineSendBytes = 64 * 1024;
// Received buffers kept for reuse once Python drops them.
constexpr size_t kMaxCachedReceiveBytes = size_t{256} << 20;
constexpr size_t kKeysNamedInErrors = 4;

std::string rank_list(const std::vector<int>& ranks) {
  std::string text = "[";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "]";
}

std::string describe_key(const MessageKey& key) {
  return describe_tag(key.second) + " from " + peer_name(key.first);
}

std::string describe_keys(const std::vector<MessageKey>& keys) {
  if (keys.size() == 1) return describe_key(keys[0]);
  std::string text = "any of " + std::to_string(keys.size()) + " messages (";
  for (size_t i = 0; i < keys.size() && i < kKeysNamedInErrors; ++i) text += (i ? "; " : "") + describe_key(keys[i]);
  if (keys.size() > kKeysNamedInErrors) text += "; ...";
  return text + ")";
}

std::string describe_tags_of(int peer, const std::vector<MessageKey>& keys) {
  std::vector<std::string> tags;
  for (const MessageKey& key : keys) {
    if (key.first == peer) tags.push_back(describe_tag(key.second));
  }
  std::string text;
  for (size_t i = 0; i < tags.size() && i < kKeysNamedInErrors; ++i) text += (i ? ", " : "") + tags[i];
  if (tags.size() > kKeysNamedInErrors) text += ", ...";
  return text;
}

}  // namespace

Transport::Transport(TransportOptions options)
    : options_(validate_options(std::move(options))),
      creator_pid_(static_cast<int>(::getpid())),
      peers_(resolve_peers(options_)),
      is_peer_(options_.world_size, false),
      pool_(BufferPool::create(kMaxCachedReceiveBytes)) {
  for (int peer : peers_) is_peer_[peer] = true;
  backend_of_.assign(options_.world_size, nullptr);
  sends_inline_.assign(options_.world_size, false);
  if (peers_.empty()) return;  // nothing to exchange with: no segment, no threads
  create_backends();
  workers_ = std::make_unique<WorkerPool>(static_cast<size_t>(options_.send_workers));
}

void Transport::create_backends() {
  std::map<std::string, std::vector<int>> peers_of;  // backend name -> its peers (names checked by validate_options)
  for (int peer : peers_) {
    auto named = options_.peer_backends.find(peer);
    peers_of[named == options_.peer_backends.end() ? default_backend_name() : named->second].push_back(peer);
  }
  for (const auto& [peer, backend] : options_.peer_backends) {
    if (peer < 0 || peer >= options_.world_size || !is_peer_[peer]) {
      throw std::invalid_argument("a backend is given for rank " + std::to_string(peer) +
                                  ", which is not among the peers " + rank_list(peers_));
    }
  }
  try {
    for (const BackendKind& kind : backend_kinds()) make_backend(kind, peers_of);
  } catch (...) {
    while (!backends_.empty()) backends_.pop_back();  // reverse order: later backends may ring an earlier one's bell
    throw;
  }
}

void Transport::make_backend(const BackendKind& kind, const std::map<std::string, std::vector<int>>& peers_of) {
  auto group = peers_of.find(kind.name);
  if (group == peers_of.end()) return;
  const BackendContext context{options_.rank,       options_.world_size, options_.job_id,
                               options_.admission_secret,                                 group->second,
                               options_.max_message_bytes, &inbox_,     arrivals_,            pool_,
                               options_.slot_bytes, options_.num_slots,  options_.listen_host, options_.listen_port};
  backends_.push_back(kind.create(context));
  Backend* backend = backends_.back().get();
  if (Doorbell* own = backend->own_arrivals()) {
    if (backends_.size() > 1) {
      throw std::logic_error(std::string("backend ") + kind.name +
                             " brings its own arrivals doorbell: it must come first in backend_registry.cpp");
    }
    arrivals_ = own;
  }
  for (int peer : group->second) {
    backend_of_[peer] = backend;
    sends_inline_[peer] = backend->sends_inline();
  }
}

Transport::~Transport() {
  if (static_cast<int>(::getpid()) != creator_pid_) {
    // Forked child: the threads are not ours and the names are the parent's. Leave everything alone.
    (void)workers_.release();
    for (auto& backend : backends_) (void)backend.release();
    return;
  }
  close();
  workers_.reset();
  while (!backends_.empty()) backends_.pop_back();  // later backends may ring an earlier one's doorbell
}

void Transport::close() {
  if (static_cast<int>(::getpid()) != creator_pid_) return;
  std::lock_guard<std::mutex> lock(close_mutex_);
  if (closing_.exchange(true)) return;
  for (auto& backend : backends_) backend->wake_senders();  // workers blocked in a send see closing_ and give up
  if (workers_) workers_->shutdown();                          // queued sends fail fast with ClosedError
  // Remote backends say goodbye and join their threads; shm closes last (also waking threads blocked in wait_any,
  // which see closing_).
  for (auto backend = backends_.rbegin(); backend != backends_.rend(); ++backend) (*backend)->close();
  if (arrivals_ == &own_arrivals_) own_arrivals_.ring();
  try {
    remove_dead_job_leftovers(options_.job_id);
  } catch (const std::exception&) {
    // Best effort: a leftover of a dead process is removed by the next close() or cleanup_job().
  }
}

std::string Transport::backend_of(int peer) const {
  validate_peer(peer, "reach");
  return backend_of_[peer]->name();
}

uint64_t Transport::strangers_dropped() const {
  uint64_t dropped = 0;
  for (const auto& backend : backends_) dropped += backend->strangers_dropped();
  return dropped;
}

std::string Transport::local_address(const std::string& backend) const {
  for (const auto& candidate : backends_) {
    if (backend == candidate->name()) return candidate->local_address();
  }
  throw std::invalid_argument("rank " + std::to_string(options_.rank) + " has no " + backend + " peers");
}

void Transport::set_peer_address(int peer, const std::string& address) {
  validate_peer(peer, "reach");
  backend_of_[peer]->set_peer_address(peer, address);
}

std::vector<std::string> Transport::cleanup_job(const std::string& job_id) { return remove_dead_job_leftovers(job_id); }

void Transport::check_usable() {
  if (closing_.load()) throw ClosedError("transport of rank " + std::to_string(options_.rank) + " is closed");
  if (static_cast<int>(::getpid()) != creator_pid_) {
    throw std::runtime_error("the transport of rank " + std::to_string(options_.rank) + " belongs to pid " +
                             std::to_string(creator_pid_) + "; a forked child cannot use it");
  }
  report_pending_failure();
}

void Transport::validate_peer(int peer, const char* action) const {
  if (peer < 0 || peer >= options_.world_size) {
    throw std::invalid_argument("peer " + std::to_string(peer) + " is out of range for world_size " +
                                std::to_string(options_.world_size));
  }
  if (peer == options_.rank) {
    throw std::invalid_argument("rank " + std::to_string(peer) + " cannot " + action + " itself");
  }
  if (!is_peer_[peer]) {
    throw std::invalid_argument("rank " + std::to_string(peer) + " is not among the peers " + rank_list(peers_) +
                                " of rank " + std::to_string(options_.rank));
  }
}

void Transport::report_pending_failure() {
  std::vector<std::shared_ptr<SendRequest>> failed;
  {
    std::lock_guard<std::mutex> lock(requests_mutex_);
    for (const auto& request : failures_) {
      if (request->claim_failure_report()) failed.push_back(request);
    }
    failures_.clear();
  }
  raise_first_failure(failed);
}

void Transport::raise_first_failure(const std::vector<std::shared_ptr<SendRequest>>& failed) {
  if (failed.empty()) return;
  if (failed.size() == 1) std::rethrow_exception(failed[0]->error());
  // One exception for a batch of failures (typically one dead peer), of the first failure's type.
  const std::string note = " (and " + std::to_string(failed.size() - 1) + " more failed sends)";
  try {
    std::rethrow_exception(failed[0]->error());
  } catch (const PeerDiedError& error) {
    throw PeerDiedError(error.what() + note);
  } catch (const ClosedError& error) {
    throw ClosedError(error.what() + note);
  } catch (const TimeoutError& error) {
    throw TimeoutError(error.what() + note);
  } catch (const std::invalid_argument& error) {
    throw std::invalid_argument(error.what() + note);
  } catch (const std::exception& error) {
    throw std::runtime_error(error.what() + note);
  }
}

std::shared_ptr<SendRequest> Transport::send(int peer, uint64_t tag, uint32_t dtype_code,
                                             const std::vector<int64_t>& shape, const void* data, uint64_t nbytes) {
  check_usable();
  validate_peer(peer, "send to");
  if (nbytes > options_.max_message_bytes) {
    throw std::invalid_argument("message of " + std::to_string(nbytes) + " bytes exceeds max_message_bytes=" +
                                std::to_string(options_.max_message_bytes));
  }
  if (nbytes > 0 && data == nullptr) throw std::invalid_argument("null data pointer for a non-empty message");
  const OutgoingMessage message{make_message_header(tag, dtype_code, shape, nbytes),
                                static_cast<const uint8_t*>(data)};
  if (sends_inline_[peer]) {
    Backend* backend = backend_of_[peer];
    uint64_t sent = 0;
    std::shared_ptr<SendRequest> rest;
    const bool handled = workers_->run_inline_if_idle(peer, [&] {
      if (backend->send_now(peer, message, &sent, kInlineSendBytes)) return true;
      if (sent == 0) return false;
      // The first chunks are sent: queue the rest on the lane before it is free again, keeping the order.
      rest = post_send(peer, message, sent);
      return true;
    });
    if (handled) return rest;  // nullptr when the whole message is sent
  }
  return post_send(peer, message, 0);
}

SlotLease Transport::reserve_slot(int peer, uint64_t tag, uint32_t dtype_code, const std::vector<int64_t>& shape,
                                  uint64_t nbytes, uint64_t offset) {
  check_usable();
  validate_peer(peer, "send to");
  if (nbytes > options_.max_message_bytes) {
    throw std::invalid_argument("message of " + std::to_string(nbytes) + " bytes exceeds max_message_bytes=" +
                                std::to_string(options_.max_message_bytes));
  }
  const OutgoingMessage message{make_message_header(tag, dtype_code, shape, nbytes), nullptr};
  return backend_of_[peer]->reserve_slot(peer, message, offset,
                                         SendLimits{options_.rank, options_.timeout_s, &closing_});
}

void Transport::commit_slot(int peer) {
  check_usable();
  validate_peer(peer, "send to");
  backend_of_[peer]->commit_slot(peer);
}

SlotRegion Transport::slot_region(int peer) {
  check_usable();
  validate_peer(peer, "send to");
  return backend_of_[peer]->slot_region(peer, SendLimits{options_.rank, options_.timeout_s, &closing_}, 0);
}

std::shared_ptr<SendRequest> Transport::post_send(int peer, const OutgoingMessage& message, uint64_t offset) {
  auto request = std::make_shared<SendRequest>();
  workers_->submit(peer, [this, request, peer, message, offset] { perform_send(request, peer, message, offset); });
  track(request);
  return request;
}

void Transport::perform_send(const std::shared_ptr<SendRequest>& request, int peer, const OutgoingMessage& message,
                             uint64_t offset) {
  try {
    if (closing_.load()) {
      throw ClosedError("transport closed before " + describe_tag(message.header.tag) + " to " + peer_name(peer) +
                        " was sent");
    }
    backend_of_[peer]->send(peer, message, SendLimits{options_.rank, options_.timeout_s, &closing_}, offset);
    request->complete();
  } catch (...) {
    request->fail(std::current_exception());
    note_failure(request);
  }
}

void Transport::note_failure(const std::shared_ptr<SendRequest>& request) {
  {
    std::lock_guard<std::mutex> lock(requests_mutex_);
    failures_.push_back(request);
  }
  if (!closing_.load()) arrivals_->ring();  // a thread blocked in wait_any reports it now
}

void Transport::track(const std::shared_ptr<SendRequest>& request) {
  std::lock_guard<std::mutex> lock(requests_mutex_);
  if (outstanding_.size() >= 64) {
    outstanding_.erase(std::remove_if(outstanding_.begin(), outstanding_.end(),
                                      [](const std::shared_ptr<SendRequest>& r) { return r->done() && !r->error(); }),
                       outstanding_.end());
  }
  outstanding_.push_back(request);
}

void Transport::wait_sends(std::optional<double> timeout_s) {
  if (timeout_s && *timeout_s < 0) throw std::invalid_argument("timeout must be >= 0");
  check_usable();
  std::vector<std::shared_ptr<SendRequest>> waiting;
  {
    std::lock_guard<std::mutex> lock(requests_mutex_);
    waiting.swap(outstanding_);
  }
  const auto give_up_at = timeout_s ? deadline_after(*timeout_s) : Clock::time_point::max();
  for (size_t i = 0; i < waiting.size(); ++i) {
    std::optional<double> remaining;
    if (timeout_s) remaining = std::max(0.0, std::chrono::duration<double>(give_up_at - Clock::now()).count());
    if (!waiting[i]->wait_done(remaining, interrupt_check_)) {
      size_t pending = 0;
      for (const auto& request : waiting) pending += request->done() ? 0 : 1;
      std::lock_guard<std::mutex> lock(requests_mutex_);
      outstanding_.insert(outstanding_.begin(), waiting.begin(), waiting.end());
      throw TimeoutError("wait_sends timed out after " + format_seconds(*timeout_s) + " with " +
                         std::to_string(pending) + " sends of rank " + std::to_string(options_.rank) +
                         " still in flight");
    }
  }
  std::vector<std::shared_ptr<SendRequest>> failed;
  for (const auto& request : waiting) {
    if (request->claim_failure_report()) failed.push_back(request);
  }
  raise_first_failure(failed);
}

std::vector<MessageKey> Transport::poll() {
  check_usable();
  collect_arrivals(/*wait_for_lock=*/false);
  return inbox_.ready();
}

std::optional<MessageHeader> Transport::peek(int peer, uint64_t tag) {
  check_usable();
  validate_peer(peer, "receive from");
  collect_arrivals(/*wait_for_lock=*/false);
  return inbox_.peek(MessageKey(peer, tag));
}

std::optional<Message> Transport::try_take(int peer, uint64_t tag) {
  check_usable();
  validate_peer(peer, "receive from");
  collect_arrivals(/*wait_for_lock=*/false);
  return inbox_.take(MessageKey(peer, tag));
}

MessageKey Transport::wait_any(const std::vector<MessageKey>& keys, std::optional<double> timeout_s) {
  check_usable();
  if (keys.empty()) throw std::invalid_argument("wait_any needs at least one (peer, tag) key");
  for (const MessageKey& key : keys) validate_peer(key.first, "receive from");
  return wait_for_keys(keys, timeout_s);
}

Message Transport::recv(int peer, uint64_t tag, std::optional<double> timeout_s) {
  check_usable();
  validate_peer(peer, "receive from");
  const std::vector<MessageKey> keys{MessageKey(peer, tag)};
  for (;;) {
    wait_for_keys(keys, timeout_s);
    if (std::optional<Message> message = inbox_.take(keys[0])) return std::move(*message);
    // Another thread took it first; wait for the next one.
  }
}

MessageKey Transport::wait_for_keys(const std::vector<MessageKey>& keys, std::optional<double> timeout_s) {
  if (timeout_s && *timeout_s < 0) throw std::invalid_argument("timeout must be >= 0");
  const double limit_s = timeout_s ? *timeout_s : options_.timeout_s;
  const auto start = Clock::now();
  const auto give_up_at = deadline_after(limit_s);
  auto next_liveness_check = start + kWaitTick;
  Doorbell& bell = *arrivals_;
  std::array<std::unique_ptr<Backend::ForegroundWait>, kBackendKinds> waiting_here;
  for (size_t i = 0; i < backends_.size(); ++i) waiting_here[i] = backends_[i]->foreground_wait();
  for (;;) {
    const uint32_t seen = bell.snapshot();
    collect_arrivals();
    if (std::optional<MessageKey> key = inbox_.find_any(keys)) return *key;
    if (closing_.load()) {
      throw ClosedError("transport of rank " + std::to_string(options_.rank) + " closed while it waited for " +
                        describe_keys(keys));
    }
    report_pending_failure();
    const auto now = Clock::now();
    if (now >= next_liveness_check) {
      if (interrupt_check_) interrupt_check_();
      if (std::optional<MessageKey> key = check_senders(keys)) return *key;
      next_liveness_check = now + kWaitTick;
    }
    if (now >= give_up_at) {
      throw TimeoutError("rank " + std::to_string(options_.rank) + " timed out after " + format_seconds(limit_s) +
                         " waiting for " + describe_keys(keys));
    }
    bell.spin_wait(seen, wait_spin(), std::min(next_liveness_check, give_up_at) - now);
  }
}

bool Transport::claim_receive(int peer, uint64_t tag) {
  check_usable();
  validate_peer(peer, "receive from");
  Backend& backend = *backend_of_[peer];
  if (!backend.claim_receive(peer, tag)) return false;
  // claim_receive copied out everything published before the claim: a message that arrived first is in the inbox.
  if (inbox_.find_any({MessageKey(peer, tag)})) {
    backend.cancel_claim(peer);
    return false;
  }
  return true;
}

ReceivedChunk Transport::next_claimed_chunk(int peer, std::optional<double> timeout_s) {
  check_usable();
  validate_peer(peer, "receive from");
  if (timeout_s && *timeout_s < 0) throw std::invalid_argument("timeout must be >= 0");
  Backend& backend = *backend_of_[peer];
  if (std::optional<ReceivedChunk> chunk = backend.next_claimed_chunk(peer)) return *chunk;
  const double limit_s = timeout_s ? *timeout_s : options_.timeout_s;
  const auto give_up_at = deadline_after(limit_s);
  // Not at once: this runs once per chunk that is not there yet, and a liveness check reads the peer's process
  // state (a dead peer is reported within a tick).
  auto next_liveness_check = Clock::now() + kWaitTick;
  Doorbell& bell = *arrivals_;
  std::unique_ptr<Backend::ForegroundWait> waiting_here = backend.foreground_wait();
  const auto what = [&] {
    return " while rank " + std::to_string(options_.rank) + " received a message from it straight from its slots";
  };
  for (;;) {
    const uint32_t seen = bell.snapshot();
    if (std::optional<ReceivedChunk> chunk = backend.next_claimed_chunk(peer)) return *chunk;
    if (closing_.load()) throw ClosedError("transport of rank " + std::to_string(options_.rank) + " closed" + what());
    const auto now = Clock::now();
    if (now >= next_liveness_check) {
      if (interrupt_check_) interrupt_check_();
      if (std::optional<PeerFailure> failure = backend.failure(peer)) {
        // failure() collected what the peer published before it went: a chunk that made it is still taken.
        if (std::optional<ReceivedChunk> chunk = backend.next_claimed_chunk(peer)) return *chunk;
        if (failure->died) throw PeerDiedError(failure->text + what());
        throw ClosedError(failure->text + what());
      }
      next_liveness_check = now + kWaitTick;
    }
    if (now >= give_up_at) {
      throw TimeoutError("rank " + std::to_string(options_.rank) + " timed out after " + format_seconds(limit_s) +
                         " waiting for the next chunk of a message from " + peer_name(peer));
    }
    bell.spin_wait(seen, wait_spin(), std::min(next_liveness_check, give_up_at) - now);
  }
}

bool Transport::release_claimed_chunk(int peer) {
  validate_peer(peer, "receive from");
  return backend_of_[peer]->release_claimed_chunk(peer);
}

void Transport::cancel_claim(int peer) {
  validate_peer(peer, "receive from");
  backend_of_[peer]->cancel_claim(peer);
}

SlotRegion Transport::receive_region(int peer) {
  check_usable();
  validate_peer(peer, "receive from");
  return backend_of_[peer]->receive_region(peer);
}

std::optional<PeerFailure> Transport::peer_failure(int peer) {
  validate_peer(peer, "receive from");
  return backend_of_[peer]->failure(peer);
}

std::optional<MessageKey> Transport::check_senders(const std::vector<MessageKey>& keys) {
  std::vector<int> checked;
  for (const MessageKey& key : keys) {
    const int peer = key.first;
    if (std::find(checked.begin(), checked.end(), peer) != checked.end()) continue;
    checked.push_back(peer);
    std::optional<PeerFailure> failure = backend_of_[peer]->failure(peer);
    if (!failure) continue;
    // The backend published everything that arrived before it noticed the failure.
    if (std::optional<MessageKey> found = inbox_.find_any(keys)) return found;
    const std::string waited =
        " while rank " + std::to_string(options_.rank) + " waited for " + describe_tags_of(peer, keys);
    if (failure->died) throw PeerDiedError(failure->text + waited);
    throw ClosedError(failure->text + waited);
  }
  return std::nullopt;
}

}  // namespace mapp
