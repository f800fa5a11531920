// How blocking calls stay responsive: they wake at least every kWaitTick to re-check that their peers are alive
// and to run the caller's interrupt check (the Python binding uses it to honour Ctrl-C while the GIL is free).
#pragma once

#include <chrono>
#include <functional>

namespace mapp {

constexpr std::chrono::milliseconds kWaitTick(100);

// May throw to abandon the wait. An empty function checks nothing.
using InterruptCheck = std::function<void()>;

}  // namespace mapp
