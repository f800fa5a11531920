#include "listener.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <deque>
#include <vector>

#include "admission.h"
#include "host_port.h"

namespace mapp {
namespace {

using Clock = std::chrono::steady_clock;

// A connection must prove the secret this fast. A real peer sends its proof one round trip after connecting.
constexpr std::chrono::seconds kAdmissionDeadline{10};
// Unproven connections held at once; beyond it the oldest goes first (a real peer's proof comes within a round
// trip, so it is never the oldest under a storm). Bounds the descriptors strangers can hold.
constexpr size_t kMaxUnproven = 128;
// How long accepting pauses when the process is out of descriptors (the pending connection keeps poll() ready).
constexpr std::chrono::milliseconds kDescriptorBackoff{100};

struct Unproven {
  TcpSocket socket;
  AdmissionChallenge challenge;
  AdmissionProof proof;
  size_t got = 0;
  Clock::time_point deadline;
};

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

std::string local_hostname() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

Listener::Listener(const std::string& host, int port, std::string secret, std::string job_id)
    : socket_(tcp_listen(host, port)),
      advertised_host_(is_wildcard(host) ? local_hostname() : host),
      port_(tcp_bound_port(socket_)),
      secret_(std::move(secret)),
      job_id_(std::move(job_id)) {}

Listener::~Listener() { stop(); }

std::string Listener::address() const { return format_host_port(advertised_host_, port_); }

void Listener::start(Admit admit) {
  admit_ = std::move(admit);
  thread_ = std::thread([this] { accept_loop(); });
}

void Listener::stop() {
  stopping_.store(true);
  stop_.signal();
  if (thread_.joinable()) thread_.join();
}

void Listener::accept_loop() {
  std::deque<Unproven> unproven;
  Clock::time_point accept_paused_until{};
  bool reported_out_of_descriptors = false;
  auto drop = [this](Unproven&) { strangers_dropped_.fetch_add(1); };  // its socket closes with it

  while (!stopping_.load()) {
    const Clock::time_point now = Clock::now();
    const bool accepting = now >= accept_paused_until;
    std::vector<pollfd> fds{{stop_.fd(), POLLIN, 0}, {accepting ? socket_.fd() : -1, POLLIN, 0}};
    Clock::time_point wake = accepting ? Clock::time_point::max() : accept_paused_until;
    for (const Unproven& connection : unproven) {
      fds.push_back({connection.socket.fd(), POLLIN, 0});
      wake = std::min(wake, connection.deadline);
    }
    const int timeout_ms = wake == Clock::time_point::max()
        ? -1
        : static_cast<int>(std::max<int64_t>(
              0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1));
    if (::poll(fds.data(), fds.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (stopping_.load() || (fds[0].revents & POLLIN)) return;

    // Unproven connections: read what arrived, admit the proven, drop the wrong, the closed and the late.
    std::deque<Unproven> still_unproven;
    const Clock::time_point after_poll = Clock::now();
    for (size_t i = 0; i < unproven.size(); ++i) {
      Unproven& connection = unproven[i];
      if (fds[2 + i].revents) {
        auto* into = reinterpret_cast<uint8_t*>(&connection.proof) + connection.got;
        const ssize_t n = ::recv(connection.socket.fd(), into, sizeof(connection.proof) - connection.got,
                                 MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          drop(connection);
          continue;
        }
        if (n > 0) connection.got += static_cast<size_t>(n);
        if (connection.got == sizeof(connection.proof)) {
          if (check_admission(connection.challenge, connection.proof, secret_, job_id_).empty()) {
            admit_(std::move(connection.socket));
          } else {
            drop(connection);
          }
          continue;
        }
      }
      if (after_poll >= connection.deadline) {
        drop(connection);
        continue;
      }
      still_unproven.push_back(std::move(connection));
    }
    unproven = std::move(still_unproven);

    if (!accepting || !(fds[1].revents & POLLIN)) continue;
    const int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        // Accepting again at once would spin: the waiting connection keeps the listening socket ready.
        if (!reported_out_of_descriptors) {
          std::fprintf(stderr, "megatron_app transport: %s: out of file descriptors accepting on %s; pausing %lld ms "
                       "between tries (reported once)\n", errno == EMFILE ? "EMFILE" : "ENFILE",
                       address().c_str(), static_cast<long long>(kDescriptorBackoff.count()));
          reported_out_of_descriptors = true;
        }
        accept_paused_until = Clock::now() + kDescriptorBackoff;
      }
      continue;  // other errors (ECONNABORTED): the connecting side retries
    }
    Unproven connection;
    connection.socket = TcpSocket(fd);
    try {
      connection.challenge = make_admission_challenge();
    } catch (const std::exception&) {
      continue;  // no random bytes for a challenge (getrandom failed): refuse this one, not the job
    }
    connection.deadline = Clock::now() + kAdmissionDeadline;
    // A fresh socket's send buffer always takes the few bytes of a challenge; one that does not is not a peer.
    if (::send(fd, &connection.challenge, sizeof(connection.challenge), MSG_DONTWAIT | MSG_NOSIGNAL) !=
        static_cast<ssize_t>(sizeof(connection.challenge))) {
      drop(connection);
      continue;
    }
    unproven.push_back(std::move(connection));
    if (unproven.size() > kMaxUnproven) {
      drop(unproven.front());
      unproven.pop_front();
    }
  }
}

}  // namespace mapp
