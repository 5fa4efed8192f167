// When glibc may hand freed heap memory back to the system, as a function of request sizes.
//
// gRPC reads the socket into 64 KiB chunks from malloc's heap (server/edge/grpc_edge.cc) and a
// request's chunks are freed once it is served. glibc returns free memory at the top of a heap once
// it exceeds M_TRIM_THRESHOLD (128 KiB by default), so a 50 MB request's receive buffers went back
// to the system after each request and were page-faulted in again by the next: ~10 ms of a medium
// request on the GPU hosts (bench/results/service-h100-2026-11-22-hot-lane.md). Keeping them costs
// up to the retained amount per malloc arena for as long as the threshold is high.
//
// So the threshold is raised to `retain_bytes` only while big requests (>= kBigRequestBytes, where
// re-faulting costs milliseconds) keep arriving, and put back to glibc's default once none has come
// for `hold`: mixed small traffic keeps glibc's usual trimming (and the soak's flat RSS).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace flashserve {

class HeapRetention {
 public:
  static constexpr int64_t kBigRequestBytes = int64_t{16} << 20;
  static constexpr int kGlibcDefaultTrimThreshold = 128 * 1024;

  /// retain_bytes 0: never changes the threshold.
  HeapRetention(int64_t retain_bytes, absl::Duration hold);

  /// Called for each request once its size is known. Thread-safe; two relaxed loads when nothing
  /// changes.
  void Observe(int64_t request_bytes);

  bool retaining() const { return retaining_.load(); }

 private:
  const int64_t retain_bytes_;
  const int64_t hold_ns_;
  std::atomic<int64_t> last_big_ns_{0};
  std::atomic<bool> retaining_{false};
};

}  // namespace flashserve
