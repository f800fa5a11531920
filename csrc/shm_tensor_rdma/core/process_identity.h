// A process named by pid plus its start time, so a recycled pid is not mistaken for a live peer.
#pragma once

#include <cstdint>

namespace mapp {

struct ProcessIdentity {
  int32_t pid = 0;
  uint64_t start_time = 0;  // field 22 of /proc/<pid>/stat (clock ticks since boot)

  static ProcessIdentity self();
  // False once the process has exited (including zombies awaiting reaping) or its pid was reused.
  bool alive() const;
};

}  // namespace mapp
