#include "unique_fd.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>

#include "errors.h"

namespace mapp {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

EventFd::EventFd() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!fd_.valid()) throw std::runtime_error(system_error_text("eventfd", errno));
}

void EventFd::signal() {
  const uint64_t one = 1;
  (void)!::write(fd_.get(), &one, sizeof(one));
}

void EventFd::clear() {
  uint64_t count = 0;
  (void)!::read(fd_.get(), &count, sizeof(count));
}

}  // namespace mapp
