// Was a stop prompt? Measured so that a loaded machine does not fail a test that is right: the
// wall time from the stop to the return within `bound`; or, when other processes kept this one off
// the CPU for longer (a CI machine running two test binaries on two cores, a CPU quota), the CPU
// time this process burnt since the stop within `threads` x `bound`, and the wall time within
// kHardBound. A pass that did not stop keeps every thread busy: seconds of CPU either way.
#pragma once

#include <gtest/gtest.h>
#include <time.h>

#include <chrono>

namespace flashserve::test {

inline std::chrono::nanoseconds ProcessCpuTime() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

/// A moment: the steady clock and this process's CPU time (all its threads).
struct StopMark {
  std::chrono::steady_clock::time_point wall = std::chrono::steady_clock::now();
  std::chrono::nanoseconds cpu = ProcessCpuTime();
};

inline constexpr std::chrono::seconds kHardBound{5};  // the unstopped passes here take 5-15 s

inline ::testing::AssertionResult StoppedPromptly(const StopMark& stop, const StopMark& end,
                                                  std::chrono::nanoseconds bound, int threads) {
  using std::chrono::duration_cast;
  using ms = std::chrono::milliseconds;
  const auto wall = duration_cast<ms>(end.wall - stop.wall);
  const auto cpu = duration_cast<ms>(end.cpu - stop.cpu);
  if (wall < bound) return ::testing::AssertionSuccess();
  if (wall < kHardBound && cpu < threads * bound) {
    return ::testing::AssertionSuccess()
           << "late by the wall clock (" << wall.count() << " ms) but only " << cpu.count()
           << " ms of CPU since the stop: the machine was busy";
  }
  return ::testing::AssertionFailure()
         << "returned " << wall.count() << " ms after the stop, having burnt " << cpu.count()
         << " ms of CPU since (bound " << duration_cast<ms>(bound).count() << " ms, x" << threads
         << " threads for CPU time)";
}

}  // namespace flashserve::test
