// Waiting, past a spin, for work that finishes on another thread or on the GPU: checking every
// ~20 us with short sleeps sees the end within about that, where a thread blocked on a futex or
// a blocking-sync event waits for its wake-up (the H100 A/B in
// bench/results/service-h100-2026-11-24-local.md: 187-229 -> 75-100 us of server overhead).
// Used by the CUDA backend's completion wait and the local socket's call waiter.
#pragma once

#include <sys/prctl.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flashserve {

/// Lets this thread's sleeps end within ~1 us of their time instead of Linux's default 50 us
/// timer slack. Costs one prctl per thread.
inline void UseFineTimerSlack() {
  thread_local const bool set = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
  (void)set;
}

/// Calls `done` after each sleep of `step` until it returns true (true) or `limit` has passed
/// (false: the caller falls back to a blocking wait).
template <typename Done>
bool PollWithShortSleeps(Done done, absl::Duration limit = absl::Milliseconds(20),
                         absl::Duration step = absl::Microseconds(20)) {
  UseFineTimerSlack();
  const absl::Time until = absl::Now() + limit;
  while (absl::Now() < until) {
    absl::SleepFor(step);
    if (done()) return true;
  }
  return false;
}

}  // namespace flashserve
