// The CPU backend's KV store: the pool is one anonymous mapping of host memory (committed by the
// kernel as pages are touched), attention gathers an item's pages into contiguous K/V and runs the
// CPU attention kernel on them. Exists so CI tests the whole Sequences API without a GPU.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "flashserve/kernels/cpu_attention.h"
#include "kvcache/kv_store.h"

namespace flashserve {

/// Copies `item`'s keys (add = 0) or values (add = format.v_offset) out of its pages in the pool
/// at `base` into `dst`, in token order, asking `stop` before each page (a 128k-token item's K is
/// hundreds of MB): false, with dst partly written, when it says stop.
bool GatherPages(const char* base, const kvcache::PageFormat& format,
                 const kvcache::PagedItem& item, int64_t add, char* dst,
                 kernels::cpu::StopSignal* stop);

/// Thread-safe (Write: disjoint ranges; Attend: its own scratch per call).
class CpuKvStore final : public kvcache::KvStore {
 public:
  /// RESOURCE_EXHAUSTED when the mapping cannot be made. `pool` (borrowed, may be null) runs
  /// the attention kernel.
  static absl::StatusOr<std::unique_ptr<CpuKvStore>> Create(int64_t bytes,
                                                            kernels::cpu::ThreadPool* pool);
  ~CpuKvStore() override;

  std::string_view kind() const override { return "cpu"; }
  int64_t capacity_bytes() const override { return bytes_; }
  /// kHost and kPageLocked sources alike; FAILED_PRECONDITION for kDevice.
  absl::Status Write(int64_t offset, const void* src, int64_t bytes, kvcache::BytesAt at) override;
  /// FAILED_PRECONDITION for an item whose q, O or LSE is kDevice. CANCELLED (outputs partly
  /// written) when batch.stop says so, within milliseconds.
  absl::Status Attend(const kvcache::PagedBatch& batch, kvcache::AttendInfo* info) override;

 private:
  CpuKvStore(char* base, int64_t bytes, kernels::cpu::ThreadPool* pool)
      : base_(base), bytes_(bytes), pool_(pool) {}
  char* const base_;
  const int64_t bytes_;
  kernels::cpu::ThreadPool* const pool_;
};

}  // namespace flashserve
