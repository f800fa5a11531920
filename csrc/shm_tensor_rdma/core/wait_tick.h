// How blocking calls stay responsive: they wake at least every kWaitTick to re-check that their peers are alive
// and to run the caller's interrupt check (the Python binding uses it to honour Ctrl-C while the GIL is free).
#pragma once

#include <chrono>
#include <functional>

namespace mapp {

constexpr std::chrono::milliseconds kWaitTick(100);

// How long a blocked call polls before it sleeps (Doorbell::spin_wait). Long enough to cover a small message's
// round trip through the peer (its Python send and our copy-out), so neither side pays a futex wake-up, which on
// a virtual machine with an idle CPU costs tens of microseconds; short enough that a rank waiting for a long time
// uses ~0% CPU. Measured on the 2-core test VM (tools/bench_transport.py): 4 KiB one-way median 38-49 us
// without, 7-14 us with.
constexpr std::chrono::microseconds kSpinBeforeSleep(50);

// May throw to abandon the wait. An empty function checks nothing.
using InterruptCheck = std::function<void()>;

using WaitClock = std::chrono::steady_clock;

// now + seconds, saturated to about a year so that huge (or infinite) timeouts cannot overflow.
inline WaitClock::time_point deadline_after(double seconds) {
  constexpr double kLongestWait = 3.0e7;
  const double clamped = seconds < 0 ? 0 : (seconds > kLongestWait ? kLongestWait : seconds);
  return WaitClock::now() +
         std::chrono::duration_cast<WaitClock::duration>(std::chrono::duration<double>(clamped));
}

}  // namespace mapp
