#include "address_book.h"

#include <stdexcept>

#include "errors.h"
#include "peer_name.h"
#include "tag.h"
#include "wait_tick.h"

namespace mapp {

AddressBook::AddressBook(std::string backend, int my_rank, const std::vector<int>& peers)
    : backend_(std::move(backend)), my_rank_(my_rank) {
  for (int peer : peers) addresses_[peer];
}

void AddressBook::set(int peer, const std::string& address) {
  const HostPort parsed = parse_host_port(address);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = addresses_.find(peer);
    if (found == addresses_.end()) {
      const bool vowel = !backend_.empty() && std::string("aeiou").find(backend_[0]) != std::string::npos;
      throw std::invalid_argument("rank " + std::to_string(peer) + " is not " + (vowel ? "an " : "a ") + backend_ +
                                  " peer of rank " + std::to_string(my_rank_));
    }
    found->second = parsed;
  }
  address_known_.notify_all();
}

std::string AddressBook::describe(int peer) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = addresses_.find(peer);
  return peer_name(peer, found == addresses_.end() ? std::nullopt : found->second);
}

AddressBook::Connection AddressBook::connect(int peer, uint64_t tag, const SendLimits& limits) {
  const auto deadline = deadline_after(limits.timeout_s);
  HostPort address;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::optional<HostPort>& known = addresses_.at(peer);
    while (!known) {
      if (limits.stopping->load() || closed_) {
        throw ClosedError("transport closed before " + describe_tag(tag) + " to " + peer_name(peer) + " was sent");
      }
      if (WaitClock::now() >= deadline) {
        throw TimeoutError("rank " + std::to_string(limits.my_rank) + " never learned the address of " +
                           peer_name(peer) + " (waited " + format_seconds(limits.timeout_s) + " to send " +
                           describe_tag(tag) + ")");
      }
      address_known_.wait_for(lock, kWaitTick);
    }
    address = *known;
  }
  TcpSocket socket;
  try {
    socket = tcp_connect(address.host, address.port, deadline, *limits.stopping);
  } catch (const TimeoutError& error) {
    throw TimeoutError("rank " + std::to_string(limits.my_rank) + " cannot reach " + peer_name(peer) + ": " +
                       error.what());
  }
  tcp_tune(socket);
  return Connection{std::move(socket), address};
}

void AddressBook::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  address_known_.notify_all();
}

}  // namespace mapp
