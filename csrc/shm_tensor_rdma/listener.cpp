#include "listener.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "host_port.h"

namespace mapp {
namespace {

bool is_wildcard(const std::string& host) { return host.empty() || host == "0.0.0.0" || host == "::"; }

std::string local_hostname() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

}  // namespace

Listener::Listener(const std::string& host, int port)
    : socket_(tcp_listen(host, port)),
      advertised_host_(is_wildcard(host) ? local_hostname() : host),
      port_(tcp_bound_port(socket_)) {}

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
  while (!stopping_.load()) {
    pollfd fds[2] = {{socket_.fd(), POLLIN, 0}, {stop_.fd(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (stopping_.load() || (fds[1].revents & POLLIN)) return;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // the connecting side retries; transient errors (ECONNABORTED, EMFILE) are its problem
    admit_(TcpSocket(fd));
  }
}

}  // namespace mapp
