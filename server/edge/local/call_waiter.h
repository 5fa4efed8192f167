// How a local connection's thread waits for its call's done(): it polls a flag for up to
// --local_spin_us (a short call is answered without the thread ever sleeping: a futex wake-up
// costs tens of microseconds on a cold core), then checks it every ~20 us with short sleeps for
// up to 20 ms (common/short_sleep_poll.h), then sleeps on a futex. Shared (shared_ptr) by
// the waiting thread and the done() callback, so the callback may still be inside Notify when
// the waiter has already returned.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/short_sleep_poll.h"

namespace flashserve {

/// Thread-safe: one waiter, one notifier.
class CallWaiter {
 public:
  /// Called once, from any thread (also inline from the waiting thread's own Submit).
  void Notify() {
    state_.store(kDone, std::memory_order_seq_cst);  // seq_cst: pairs with sleeping_
    if (sleeping_.load(std::memory_order_seq_cst)) Wake();
  }

  /// Returns once Notify was called. Polls for `spin`, then sleeps.
  void Wait(absl::Duration spin) {
    if (Done()) return;
    const absl::Time until = absl::Now() + spin;
    while (absl::Now() < until) {
      for (int i = 0; i < 64; ++i) {
        if (Done()) return;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
    }
    if (spin > absl::ZeroDuration() && PollWithShortSleeps([this] { return Done(); })) return;
    sleeping_.store(true, std::memory_order_seq_cst);
    while (!Done()) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAIT_PRIVATE, kPending,
              nullptr, nullptr, 0);
    }
  }

  bool Done() const { return state_.load(std::memory_order_seq_cst) == kDone; }

 private:
  static constexpr uint32_t kPending = 0, kDone = 1;
  void Wake() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&state_), FUTEX_WAKE_PRIVATE, 1, nullptr,
            nullptr, 0);
  }
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
  std::atomic<uint32_t> state_{kPending};
  std::atomic<bool> sleeping_{false};
};

}  // namespace flashserve
