// Log lines that clients cause -- one per refused or failed call -- at a bounded rate: a client
// sending bad calls as fast as it could wrote ~30 MB of warnings per second.
#pragma once

#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"

namespace flashserve {

/// Warnings per second that clients can cause, and how many may come at once; past them the
/// lines go at debug level and the next warning says how many did.
inline constexpr double kClientWarningsPerSecond = 10;
inline constexpr double kClientWarningsBurst = 50;

/// Thread-safe token bucket (one per process for client-caused lines).
class ClientLogBudget {
 public:
  struct Slot {
    spdlog::level::level_enum level = spdlog::level::warn;
    int64_t demoted_before = 0;  // lines sent at debug since the last warning
  };
  Slot Take(absl::Time now);

 private:
  absl::Mutex mu_;
  double tokens_ ABSL_GUARDED_BY(mu_) = kClientWarningsBurst;
  absl::Time refilled_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int64_t demoted_ ABSL_GUARDED_BY(mu_) = 0;
};

ClientLogBudget& ProcessClientLogBudget();

/// Whether a failure with this code is the client's doing (bad input, unknown ids, limits, its
/// own deadline or cancel) and so within the budget; a server fault (INTERNAL, UNKNOWN, DATA_LOSS,
/// UNAVAILABLE: a broken device, a draining server) always warns -- a flood of bad calls must not
/// hide one.
bool ClientCaused(absl::StatusCode code);

/// spdlog::warn for the log line of a failure with `code`: within the process's budget (else at
/// debug) when ClientCaused(code), always otherwise.
template <typename... Args>
void WarnFailure(absl::StatusCode code, spdlog::format_string_t<Args...> format, Args&&... args) {
  if (!ClientCaused(code)) {
    spdlog::warn(format, std::forward<Args>(args)...);
    return;
  }
  const ClientLogBudget::Slot slot = ProcessClientLogBudget().Take(absl::Now());
  spdlog::log(slot.level, format, std::forward<Args>(args)...);
  if (slot.demoted_before > 0) {
    spdlog::warn(
        "({} lines like the one above went to debug level before it: clients may cause "
        "at most {} warnings per second)",
        slot.demoted_before, kClientWarningsPerSecond);
  }
}

}  // namespace flashserve
