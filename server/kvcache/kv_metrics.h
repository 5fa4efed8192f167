// The KV cache's metrics (flashserve_kv_*), registered in the server's registry. README.md,
// "Sequences", lists them.
#pragma once

#include <cstdint>
#include <string_view>

#include "metrics/metrics.h"

namespace flashserve::kvcache {

/// Thread-safe (lock-free updates). Every series exists from construction, at 0.
class KvCacheMetrics {
 public:
  explicit KvCacheMetrics(metrics::Registry* registry);

  /// Gauges: live sequences, pool bytes used / free / capacity, pages held.
  void SetPool(int64_t sequences, int64_t used_bytes, int64_t capacity_bytes, int64_t pages_used);
  void RecordCreated() { created_->Increment(); }
  void RecordReleased(int64_t n) { released_->Increment(uint64_t(n)); }
  void RecordEvicted(int64_t n) { evicted_->Increment(uint64_t(n)); }
  /// reason: "pool_full", "max_sequences", "not_found" or "length_mismatch" (expected_length).
  void RecordRefused(std::string_view reason);
  /// Layers of an Append or DecodeStep items whose expected_length found their rows already
  /// appended by an earlier try (a retry after a lost answer), not appended again.
  void RecordAlreadyAppended(int64_t n) { already_appended_->Increment(uint64_t(n)); }
  /// A CreateSequence whose create_token named a sequence an earlier try made (a retry after a
  /// lost answer): answered with it, nothing created.
  void RecordAlreadyCreated() { already_created_->Increment(); }
  /// Tokens a Truncate dropped (summed over its layers): draft tokens the model rejected.
  void RecordTruncated(int64_t tokens) { truncated_->Increment(uint64_t(tokens)); }
  /// One paged launch: sequences (items) in it and DecodeStep calls merged into it.
  void RecordLaunch(int64_t sequences, int64_t calls);

 private:
  metrics::Gauge* sequences_;
  metrics::Gauge* used_bytes_;
  metrics::Gauge* capacity_bytes_;
  metrics::Gauge* free_bytes_;
  metrics::Gauge* pages_used_;
  metrics::Counter* created_;
  metrics::Counter* released_;
  metrics::Counter* evicted_;
  metrics::Counter* already_appended_;
  metrics::Counter* already_created_;
  metrics::Counter* truncated_;
  metrics::Family<metrics::Counter>* refused_;
  metrics::Histogram* launch_sequences_;
  metrics::Histogram* launch_calls_;
};

}  // namespace flashserve::kvcache
