#include "kvcache/kv_metrics.h"

namespace flashserve::kvcache {

KvCacheMetrics::KvCacheMetrics(metrics::Registry* registry) {
  sequences_ = registry->AddGauge("flashserve_kv_sequences", "Live KV cache sequences").Get();
  auto& bytes =
      registry->AddGauge("flashserve_kv_pool_bytes",
                         "KV pool bytes: held in pages (used), not held (free), in all (capacity)", {"state"});
  used_bytes_ = bytes.Labels({"used"});
  capacity_bytes_ = bytes.Labels({"capacity"});
  free_bytes_ = bytes.Labels({"free"});
  pages_used_ = registry->AddGauge("flashserve_kv_pages_used", "KV pool pages held").Get();
  created_ =
      registry->AddCounter("flashserve_kv_sequences_created_total", "Sequences created").Get();
  released_ = registry
                  ->AddCounter("flashserve_kv_sequences_released_total",
                               "Sequences released by a Release call")
                  .Get();
  evicted_ = registry
                 ->AddCounter("flashserve_kv_evictions_total",
                              "Sequences evicted after --sequence_ttl_s idle")
                 .Get();
  already_appended_ = registry
                          ->AddCounter("flashserve_kv_already_appended_total",
                                       "Appends (an Append's layer, a DecodeStep item) whose "
                                       "expected_length found the rows appended by an earlier try")
                          .Get();
  already_created_ = registry
                         ->AddCounter("flashserve_kv_sequences_already_created_total",
                                      "CreateSequence calls whose create_token named the sequence "
                                      "an earlier try created: answered with it, nothing created")
                         .Get();
  truncated_ = registry
                   ->AddCounter("flashserve_kv_truncated_tokens_total",
                                "Tokens dropped by Truncate calls, summed over the layers cut")
                   .Get();
  refused_ = &registry->AddCounter("flashserve_kv_refusals_total",
                                   "Sequence calls refused, by reason", {"reason"});
  for (std::string_view reason : {"pool_full", "max_sequences", "not_found", "length_mismatch"}) {
    refused_->Labels({reason});
  }
  launch_sequences_ =
      registry
          ->AddHistogram("flashserve_kv_launch_sequences", "Sequences in one paged decode launch",
                         {}, metrics::ExponentialBuckets(1, 2, 11))
          .Get();
  launch_calls_ = registry
                      ->AddHistogram("flashserve_kv_launch_calls",
                                     "DecodeStep/Attend calls merged into one paged launch", {},
                                     metrics::ExponentialBuckets(1, 2, 8))
                      .Get();
}

void KvCacheMetrics::SetPool(int64_t sequences, int64_t used_bytes, int64_t capacity_bytes,
                             int64_t pages_used) {
  sequences_->Set(double(sequences));
  used_bytes_->Set(double(used_bytes));
  capacity_bytes_->Set(double(capacity_bytes));
  free_bytes_->Set(double(capacity_bytes - used_bytes));
  pages_used_->Set(double(pages_used));
}

void KvCacheMetrics::RecordRefused(std::string_view reason) {
  refused_->Labels({reason})->Increment();
}

void KvCacheMetrics::RecordLaunch(int64_t sequences, int64_t calls) {
  launch_sequences_->Observe(double(sequences));
  launch_calls_->Observe(double(calls));
}

}  // namespace flashserve::kvcache
