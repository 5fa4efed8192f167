#include "memory/heap_retention.h"

#include <malloc.h>

#include <chrono>

#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

void SetMallocThresholds(int64_t mmap_threshold, int64_t trim_threshold) {
  // A sanitizer's allocator refuses: nothing to tune. (With jemalloc preloaded glibc's mallopt
  // answers, for an allocator nobody uses: config/host_memory.cc warns.)
  if (mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) != 1 ||
      mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) != 1) {
    spdlog::debug("mallopt refused (mmap threshold {}, trim threshold {})", mmap_threshold,
                  trim_threshold);
  }
}

// The hold is measured on the steady clock, as the ender's waits are: a wall clock stepped back
// kept the thresholds raised (and the final trim away) for as long again.
int64_t SteadyNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

HeapRetention::HeapRetention(int64_t retain_bytes, int64_t base_mmap_threshold,
                             absl::Duration hold)
    : retain_bytes_(base_mmap_threshold > 0 ? retain_bytes : 0),
      base_mmap_threshold_(base_mmap_threshold),
      hold_ns_(absl::ToInt64Nanoseconds(hold)) {
  if (retain_bytes_ > 0) ender_ = std::thread([this] { EndAfterHold(); });
}

HeapRetention::~HeapRetention() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (ender_.joinable()) ender_.join();
}

void HeapRetention::Observe(int64_t request_bytes) {
  if (request_bytes >= kBigRequestBytes) Retain();
}

void HeapRetention::Retain() {
  if (retain_bytes_ <= 0) return;
  last_retain_ns_.store(SteadyNanos(), std::memory_order_relaxed);
  if (retaining_.load(std::memory_order_relaxed)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (retaining_.load()) return;
    SetMallocThresholds(kRetainingMmapThreshold, retain_bytes_);
    retaining_.store(true);
  }
  spdlog::debug(
      "heap: retaining freed memory (a big request or a decode step) until {} ms after the last",
      hold_ns_ / 1000000);
  cv_.notify_all();
}

void HeapRetention::EndAfterHold() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (!retaining_.load()) {
      cv_.wait(lock, [this] { return stop_ || retaining_.load(); });
      continue;
    }
    const int64_t wait_ns = last_retain_ns_.load() + hold_ns_ - SteadyNanos();
    if (wait_ns > 0) {
      cv_.wait_for(lock, std::chrono::nanoseconds(wait_ns), [this] { return stop_; });
      continue;
    }
    SetMallocThresholds(base_mmap_threshold_, kGlibcDefaultTrimThreshold);
    retaining_.store(false);
    malloc_trim(0);  // what was kept goes back now, not at some later free
    spdlog::debug("heap: retention ended, freed memory given back");
  }
}

}  // namespace flashserve
