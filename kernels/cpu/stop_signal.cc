// cpu::StopSignal: the kernels' threads share one poll of the caller's condition per interval,
// so a slow condition (a clock, a gRPC context) costs nothing per key tile.
#include <time.h>

#include "flashserve/kernels/cpu_attention.h"

namespace flashserve::kernels::cpu {

bool StopSignal::Poll() {
  // The coarse clock costs ~4 ns a read (steady_clock ~18 ns), a key tile 1-200 us; it advances
  // every 1-4 ms, so polls come at most that often, well within the stop's ~100 ms budget.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const int64_t now = int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
  int64_t due = next_poll_ns_.load(std::memory_order_relaxed);
  // Only the thread that moves the next poll forward asks.
  if (now < due || !next_poll_ns_.compare_exchange_strong(due, now + poll_every_ns_,
                                                          std::memory_order_relaxed)) {
    return false;
  }
  if (!poll_()) return false;
  request();
  return true;
}

}  // namespace flashserve::kernels::cpu
