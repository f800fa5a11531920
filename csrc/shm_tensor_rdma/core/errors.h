// Exception types of the transport core. bindings.cpp maps each to a Python exception:
//   std::invalid_argument -> ValueError, TimeoutError -> TransportTimeout (a TimeoutError),
//   PeerDiedError -> PeerDied (a RuntimeError), ClosedError -> TransportClosed (a RuntimeError).
#pragma once

#include <stdexcept>
#include <string>

namespace mapp {

class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class PeerDiedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "open /dev/shm/x: No such file or directory" style text for a failed system call.
std::string system_error_text(const std::string& what, int errnum);
// "2.5 s"
std::string format_seconds(double seconds);
// Bytes another process sent, fit to quote in an error: anything but printable ASCII becomes \xNN (error texts
// become Python str, which must be valid UTF-8, and must not carry a peer's control characters into a log).
std::string printable_text(const std::string& untrusted);

}  // namespace mapp
