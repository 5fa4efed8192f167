// The tensor bytes of accepted, unanswered calls, counted against --max_inflight_bytes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace flashserve {

/// Thread-safe. Shared by AttentionRuntime and what a call holds (CallHold), so that a call
/// answered after the runtime is gone still gives its bytes back somewhere alive, as an Admission
/// does with its count.
class InflightBytes {
 public:
  explicit InflightBytes(int64_t limit) : limit_(limit) {}
  InflightBytes(const InflightBytes&) = delete;
  InflightBytes& operator=(const InflightBytes&) = delete;

  /// Counts `bytes`; RESOURCE_EXHAUSTED (nothing counted) when they would pass the limit while
  /// other bytes are in flight (a call alone may be larger than the limit: it would never run).
  absl::Status Reserve(int64_t bytes) {
    const int64_t before = held_.fetch_add(bytes);
    if (limit_ > 0 && before + bytes > limit_ && before > 0) {
      held_.fetch_sub(bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("server busy: ", before, " tensor bytes in flight + ", bytes,
                       " for this request exceed --max_inflight_bytes=", limit_));
    }
    return absl::OkStatus();
  }
  void Release(int64_t bytes) { held_.fetch_sub(bytes); }
  int64_t held() const { return held_.load(); }

 private:
  const int64_t limit_;  // 0: no limit
  std::atomic<int64_t> held_{0};
};

/// `bytes` counted on `budget` (reserved by the caller), given back when the last owner goes.
class InflightReservation {
 public:
  InflightReservation(std::shared_ptr<InflightBytes> budget, int64_t bytes)
      : budget_(std::move(budget)), bytes_(bytes) {}
  ~InflightReservation() { budget_->Release(bytes_); }
  InflightReservation(const InflightReservation&) = delete;
  InflightReservation& operator=(const InflightReservation&) = delete;

 private:
  const std::shared_ptr<InflightBytes> budget_;
  const int64_t bytes_;
};

}  // namespace flashserve
