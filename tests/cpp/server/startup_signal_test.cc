// StartupSignalWatch (config/serve_loop.h): a shutdown signal during startup ends a start that
// does not return within kStartupStopGrace (exit 0, no destructors), asks one that polls
// StartupStopRequested() to stop, and is handed to the serve loop's wait when the start finishes.
#include <signal.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/time/clock.h"
#include "config/serve_loop.h"
#include "config/server_config.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

// Waits up to `limit` for StartupStopRequested(): whether it turned true.
bool StopRequestedWithin(absl::Duration limit) {
  const absl::Time deadline = absl::Now() + limit;
  while (!StartupStopRequested()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST(StartupSignalWatchDeathTest, ASignalEndsAStartThatHangs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto hung_start = [] {
    BlockShutdownSignals();
    StartupSignalWatch watch;
    kill(getpid(), SIGTERM);
    absl::SleepFor(absl::Seconds(60));  // a DNS lookup that never answers
    std::exit(7);
  };
  const absl::Time start = absl::Now();
  // Its log line goes to stdout (spdlog's default logger), which death tests do not match.
  EXPECT_EXIT(hung_start(), ::testing::ExitedWithCode(ShutdownOptions::kExitOk), "");
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));  // the death test's re-run included
}

TEST(StartupSignalWatchTest, ASignalAsksTheStartToStop) {
  BlockShutdownSignals();
  StartupSignalWatch watch;
  EXPECT_FALSE(StartupStopRequested());
  ASSERT_EQ(kill(getpid(), SIGINT), 0);
  EXPECT_TRUE(StopRequestedWithin(absl::Seconds(5)));
  watch.End();  // the start unwound in time: no exit; the signal is pending again
  EXPECT_TRUE(ShutdownSignalPending());
  EXPECT_FALSE(ShutdownSignalPending());
}

TEST(StartupSignalWatchTest, ASignalTakenJustBeforeTheStartEndedGoesToTheServeLoop) {
  BlockShutdownSignals();
  StartupSignalWatch watch;
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  ASSERT_TRUE(StopRequestedWithin(absl::Seconds(5)));
  watch.End();
  const StopEvent stop = WaitForStop([] { return true; }, absl::Seconds(5));
  EXPECT_EQ(stop.reason, StopReason::kSignal);
  EXPECT_EQ(stop.signal_number, SIGTERM);
}

TEST(StartupSignalWatchTest, EndingWithoutASignalIsQuickAndLeavesTheSignalsToTheServeLoop) {
  BlockShutdownSignals();
  const absl::Time start = absl::Now();
  {
    StartupSignalWatch watch;
    watch.End();
  }  // End() again, from the destructor: nothing more
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_FALSE(ShutdownSignalPending());
  ASSERT_EQ(kill(getpid(), SIGTERM), 0);
  EXPECT_TRUE(StartupStopRequested());  // no watch: the pending signal, taken
  EXPECT_FALSE(ShutdownSignalPending());
}

}  // namespace
}  // namespace flashserve
