#include "common/heap_retention.h"

#include <malloc.h>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

void SetTrimThreshold(int64_t bytes) {
  if (mallopt(M_TRIM_THRESHOLD, int(bytes)) != 1) {
    // Another allocator (a sanitizer's, jemalloc via LD_PRELOAD): nothing to tune.
    spdlog::debug("mallopt(M_TRIM_THRESHOLD, {}) refused", bytes);
  }
}

}  // namespace

HeapRetention::HeapRetention(int64_t retain_bytes, absl::Duration hold)
    : retain_bytes_(retain_bytes), hold_ns_(absl::ToInt64Nanoseconds(hold)) {}

void HeapRetention::Observe(int64_t request_bytes) {
  if (retain_bytes_ <= 0) return;
  const int64_t now = absl::GetCurrentTimeNanos();
  if (request_bytes >= kBigRequestBytes) {
    last_big_ns_.store(now, std::memory_order_relaxed);
    if (!retaining_.load(std::memory_order_relaxed) && !retaining_.exchange(true)) {
      SetTrimThreshold(retain_bytes_);
    }
  } else if (retaining_.load(std::memory_order_relaxed) &&
             now - last_big_ns_.load(std::memory_order_relaxed) > hold_ns_) {
    // A big request racing with this may find the threshold lowered; the next one raises it again.
    if (retaining_.exchange(false)) SetTrimThreshold(kGlibcDefaultTrimThreshold);
  }
}

}  // namespace flashserve
