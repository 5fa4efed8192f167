#include "common/client_log.h"

#include <algorithm>

namespace flashserve {

ClientLogBudget::Slot ClientLogBudget::Take(absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (refilled_ != absl::InfinitePast()) {
    const double earned = absl::ToDoubleSeconds(now - refilled_) * kClientWarningsPerSecond;
    tokens_ = std::min(kClientWarningsBurst, tokens_ + std::max(0.0, earned));
  }
  refilled_ = now;
  Slot slot;
  if (tokens_ < 1) {
    ++demoted_;
    slot.level = spdlog::level::debug;
    return slot;
  }
  tokens_ -= 1;
  slot.demoted_before = std::exchange(demoted_, 0);
  return slot;
}

bool ClientCaused(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnavailable:
      return false;
    default:
      return true;
  }
}

ClientLogBudget& ProcessClientLogBudget() {
  static ClientLogBudget* budget = new ClientLogBudget();
  return *budget;
}

}  // namespace flashserve
