#include "memory/heap_retention.h"

#include <malloc.h>

#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

void SetMallocThresholds(int64_t mmap_threshold, int64_t trim_threshold) {
  // Another allocator (a sanitizer's, jemalloc via LD_PRELOAD) refuses: nothing to tune.
  if (mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) != 1 ||
      mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) != 1) {
    spdlog::debug("mallopt refused (mmap threshold {}, trim threshold {})", mmap_threshold,
                  trim_threshold);
  }
}

}  // namespace

HeapRetention::HeapRetention(int64_t retain_bytes, int64_t base_mmap_threshold,
                             absl::Duration hold)
    : retain_bytes_(base_mmap_threshold > 0 ? retain_bytes : 0),
      base_mmap_threshold_(base_mmap_threshold),
      hold_ns_(absl::ToInt64Nanoseconds(hold)) {}

void HeapRetention::Observe(int64_t request_bytes) {
  if (retain_bytes_ <= 0) return;
  if (request_bytes >= kBigRequestBytes) {
    Retain();
  } else if (retaining_.load(std::memory_order_relaxed) &&
             absl::GetCurrentTimeNanos() - last_retain_ns_.load(std::memory_order_relaxed) >
                 hold_ns_) {
    // A Retain() racing with this may find the thresholds lowered; the next one raises them.
    if (retaining_.exchange(false)) {
      SetMallocThresholds(base_mmap_threshold_, kGlibcDefaultTrimThreshold);
    }
  }
}

void HeapRetention::Retain() {
  if (retain_bytes_ <= 0) return;
  last_retain_ns_.store(absl::GetCurrentTimeNanos(), std::memory_order_relaxed);
  if (!retaining_.load(std::memory_order_relaxed) && !retaining_.exchange(true)) {
    SetMallocThresholds(kRetainingMmapThreshold, retain_bytes_);
  }
}

}  // namespace flashserve
