// Where the KV pool's bytes live and the attention over them: one implementation per backend
// (host memory: runtime/cpu_kv_store.h; device memory: runtime/cuda_kv_store.h). The cache layer
// decides which pages hold what; the store only copies bytes and runs launches.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "kvcache/kv_types.h"

namespace flashserve::kvcache {

/// Thread-safe: Write and Attend are called concurrently.
class KvStore {
 public:
  virtual ~KvStore() = default;
  /// "cpu" (host memory) or "cuda" (device memory).
  virtual std::string_view kind() const = 0;
  /// Bytes of the arena (offsets handed to Write lie in [0, capacity_bytes)).
  virtual int64_t capacity_bytes() const = 0;
  /// Copies `bytes` host bytes from `src` to the arena at `offset`. A Write that returned before
  /// an Attend was started is visible to it; `src` may be reused once Write returns.
  virtual absl::Status Write(int64_t offset, const void* src, int64_t bytes) = 0;
  /// Pages were freed and may be written by another sequence next: a Write issued before this
  /// call must land before any Write issued after it (a store that defers writes flushes here).
  virtual void Fence() {}
  /// Attention of every item against its pages; returns once every out/lse is written.
  /// `info` receives the name of what ran and its times. INTERNAL on a device fault.
  virtual absl::Status Attend(const PagedBatch& batch, AttendInfo* info) = 0;
  /// Head dims Attend supports (empty: any in [1, 256]).
  virtual std::vector<int> head_dims() const { return {}; }
};

}  // namespace flashserve::kvcache
