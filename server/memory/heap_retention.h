// Whether big requests' receive buffers (and decode steps' buffers) come from malloc's heap and
// stay there between requests.
//
// gRPC reads the socket into chunks of 256 KiB to 4 MiB (server/edge/grpc/grpc_edge.cc). Above
// glibc's mmap threshold (--malloc_mmap_threshold_bytes, 128 KiB) each chunk is its own mmap:
// zero-filled and page-faulted in while the request arrives, unmapped when it has been served. For
// a 50 MB request that was ~10 ms of its ~40 ms on the GPU hosts
// (bench/results/service-h100-2026-11-22-hot-lane.md). From the heap, with its top kept mapped
// (M_TRIM_THRESHOLD), the next request reuses the same pages. Keeping them costs up to the retained
// amount per malloc arena, and a low mmap threshold is what keeps the RSS of mixed small traffic
// flat (tests/soak/RESULTS.md).
//
// So both thresholds are raised only while big requests (>= kBigRequestBytes: Attention, a
// sequence's CreateSequence / Append) or decode steps keep arriving, and put back -- the kept heap
// trimmed -- once none has come for `hold`, by a thread of its own: when it was the next small
// request that ended it, traffic that never calls Observe (the local socket's Echo, KServe, or
// none at all) kept hundreds of MB after one decode step. A typed request's tensors are message strings: an 8k-token prefix of a
// Llama-3-8B-like layer parses into two 16 MiB strings, ~8,000 page faults per CreateSequence while
// they were mmaps of their own (tests/python/test_decode_heap.py). A decode step is small (~1 MB
// for 64 sequences) but frees its message strings, arena blocks and outputs together after each
// answer and the next step allocates them again: with glibc's 128 KiB trim threshold the heap's top
// went back to the system after each step and came back page by page (H200, one client, 64-sequence
// steps over gRPC: 50-180 page faults and 0.08-0.6 ms per step;
// bench/results/service-h200-2026-11-28-decode-grpc.md).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include "absl/time/time.h"

namespace flashserve {

class HeapRetention {
 public:
  static constexpr int64_t kBigRequestBytes = int64_t{16} << 20;
  // Above gRPC's largest read chunk, so every chunk comes from the heap while retaining, and at
  // the ceiling glibc gives its own dynamic threshold (32 MiB on 64-bit; a thread arena's heap is
  // 64 MiB), so that the message strings of a sequence's prefix (16 MiB each at 8k tokens) do too.
  static constexpr int kRetainingMmapThreshold = 32 << 20;
  static constexpr int kGlibcDefaultTrimThreshold = 128 * 1024;

  /// retain_bytes: trim threshold while retaining; 0 disables. base_mmap_threshold: the mmap
  /// threshold otherwise (the server's --malloc_mmap_threshold_bytes); 0 (glibc's dynamic default,
  /// which already keeps big buffers) disables too.
  HeapRetention(int64_t retain_bytes, int64_t base_mmap_threshold, absl::Duration hold);
  ~HeapRetention();
  HeapRetention(const HeapRetention&) = delete;
  HeapRetention& operator=(const HeapRetention&) = delete;

  /// Called for each request once its size is known: a big one retains. Thread-safe; a small
  /// request costs nothing.
  void Observe(int64_t request_bytes);
  /// A call whose buffers the next call will want again arrived (a big request, a decode step):
  /// retain from now until `hold` after the last such call. Thread-safe; reads the clock.
  void Retain();

  bool retaining() const { return retaining_.load(); }

 private:
  // The thread: ends retention `hold` after the last Retain (thresholds back, heap trimmed).
  void EndAfterHold();

  const int64_t retain_bytes_;
  const int64_t base_mmap_threshold_;
  const int64_t hold_ns_;
  std::atomic<int64_t> last_retain_ns_{0};
  std::atomic<bool> retaining_{false};
  std::mutex mu_;  // guards the transitions (mallopt calls) and stop_
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread ender_;  // last: started once the rest is set up; only when retention is enabled
};

}  // namespace flashserve
