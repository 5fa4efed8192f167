// The budget of warnings clients can cause: a burst, then a steady rate; past it lines go at debug
// and the next warning counts them.
#include "common/client_log.h"

#include "gtest/gtest.h"

namespace flashserve {
namespace {

TEST(ClientLogBudget, ABurstThenTheRateAndTheDemotedAreCounted) {
  ClientLogBudget budget;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  int warnings = 0;
  for (int i = 0; i < 1000; ++i) {  // a flood within one instant
    warnings += budget.Take(t0).level == spdlog::level::warn;
  }
  EXPECT_EQ(warnings, int(kClientWarningsBurst));
  // One second later: the rate's worth again; the first of them says how many went to debug.
  const ClientLogBudget::Slot next = budget.Take(t0 + absl::Seconds(1));
  EXPECT_EQ(next.level, spdlog::level::warn);
  EXPECT_EQ(next.demoted_before, 1000 - int(kClientWarningsBurst));
  warnings = 1;
  for (int i = 0; i < 100; ++i)
    warnings += budget.Take(t0 + absl::Seconds(1)).level == spdlog::level::warn;
  EXPECT_EQ(warnings, int(kClientWarningsPerSecond));
  // Quiet for a minute: the burst is back, no more.
  warnings = 0;
  for (int i = 0; i < 1000; ++i)
    warnings += budget.Take(t0 + absl::Seconds(61)).level == spdlog::level::warn;
  EXPECT_EQ(warnings, int(kClientWarningsBurst));
}

TEST(ClientLogBudget, AClockGoingBackEarnsNothing) {
  ClientLogBudget budget;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (int i = 0; i < 100; ++i) budget.Take(t0);
  EXPECT_EQ(budget.Take(t0 - absl::Seconds(30)).level, spdlog::level::debug);
}

// A flood of bad calls spends the budget; a server fault's line must still be a warning.
TEST(ClientLogBudget, OnlyClientCausedCodesAreBudgeted) {
  for (absl::StatusCode code : {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
                                absl::StatusCode::kResourceExhausted, absl::StatusCode::kCancelled,
                                absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted}) {
    EXPECT_TRUE(ClientCaused(code)) << absl::StatusCodeToString(code);
  }
  for (absl::StatusCode code : {absl::StatusCode::kInternal, absl::StatusCode::kUnknown,
                                absl::StatusCode::kDataLoss, absl::StatusCode::kUnavailable}) {
    EXPECT_FALSE(ClientCaused(code)) << absl::StatusCodeToString(code);
  }
}

}  // namespace
}  // namespace flashserve
