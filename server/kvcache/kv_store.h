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
  /// Copies `bytes` bytes from `src` (in the memory `at` says) to the arena at `offset`. A Write
  /// that returned before an Attend was started is visible to it. A kHost `src` may be reused
  /// once AwaitSources returns (a store may read one that is in fact page-locked after Write
  /// returned); a kPageLocked / kDevice one may be read until the next Attend returns (the caller
  /// keeps it alive until then). FAILED_PRECONDITION for memory the store cannot read.
  virtual absl::Status Write(int64_t offset, const void* src, int64_t bytes, BytesAt at) = 0;
  /// Returns once every kHost source the calling thread handed to Write before this call has
  /// been read (the SequenceCache writes a call's rows and waits on one thread).
  virtual absl::Status AwaitSources() { return absl::OkStatus(); }
  /// Pages were freed and may be written by another sequence next: a Write issued before this
  /// call must land before any Write issued after it (a store that defers writes flushes here).
  virtual void Fence() {}
  /// Returns once every Write issued before this call has landed and no longer reads its source.
  /// A step that fails after writing some of its rows calls it before the call ends, since the
  /// rows it wrote may come from a client's region, whose lease ends with the call.
  virtual absl::Status Settle() { return absl::OkStatus(); }
  /// Attention of every item against its pages; returns once every out/lse is written.
  /// `info` receives the name of what ran and its times. INTERNAL on a device fault.
  virtual absl::Status Attend(const PagedBatch& batch, AttendInfo* info) = 0;
  /// The CUDA device whose memory kDevice bytes must be on (-1: the store reads host memory only).
  virtual int device() const { return -1; }
  /// Head dims Attend supports (empty: any in [1, 256]).
  virtual std::vector<int> head_dims() const { return {}; }
};

}  // namespace flashserve::kvcache
