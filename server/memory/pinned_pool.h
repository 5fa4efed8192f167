// A pool of page-locked ("pinned") host staging buffers for the CUDA backend: request tensors are
// copied into one before their H2D copy, and results land in one after their D2H copy.
//
// Pinning is expensive (cudaHostAlloc maps and locks pages: milliseconds per GiB) and pinned
// memory is a scarce system resource, so buffers are kept and reused instead of freed:
// - sizes are rounded up to a power-of-two size class (at least min_class_bytes), one free list per
//   class; a released buffer goes back on its list and the next request of that class reuses it
//   without touching the allocator;
// - `capacity_bytes` caps everything the pool holds from the allocator (in use + cached). When a new
//   buffer would pass the cap, cached buffers of other classes are freed first; if that is not
//   enough, Acquire returns an empty Buffer and the caller decides (the CUDA backend falls back to
//   pageable copies for that request; see cuda_backend.cc).
// The actual allocator is behind HostAllocator so the logic is tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"

namespace flashserve {

/// Where the pool's memory comes from: cudaHostAlloc/cudaFreeHost in the server, malloc in tests.
/// Must be thread-safe (called without the pool's lock held).
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  /// nullptr on failure.
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* pointer) = 0;
};

struct PinnedPoolOptions {
  size_t capacity_bytes = size_t{2} << 30;  // everything held from the allocator; 0: pool disabled
  size_t min_class_bytes = size_t{64} << 10;  // smallest size class (rounded up to a power of two)
  // Whether the allocator's memory is page-locked (the CUDA backend's) or ordinary heap memory
  // (the CPU backend pools its request buffers the same way, for reuse without page faults).
  bool page_locked = true;
  // Spare (released) buffers kept per size class; more are freed on release. 0: no limit (pinning
  // is expensive, so the CUDA backend keeps every spare under the cap; the CPU backend keeps a few:
  // its buffers only save page faults, and spares nobody reuses would be resident memory).
  size_t max_cached_per_class = 0;
};

/// Ordinary heap memory (64-byte aligned): the CPU backend's request-buffer pool.
class HeapAllocator final : public HostAllocator {
 public:
  void* Allocate(size_t bytes) override;
  void Free(void* pointer) override;
};

struct PinnedPoolStats {
  int64_t used_bytes = 0;      // in buffers handed out now (class sizes)
  int64_t reserved_bytes = 0;  // held from the allocator: used + cached
  int64_t allocations = 0;     // Allocate calls that succeeded
  int64_t reuses = 0;          // Acquires served from a free list
  int64_t evictions = 0;       // cached buffers freed to make room under the cap
  int64_t refusals = 0;        // Acquires that got an empty Buffer
};

/// Thread-safe. A Buffer may outlive the pool (nothing in gRPC's API promises an answer's slices
/// are dropped before the server destroys the backend that owns the pool): returned then, it is
/// freed at once.
class PinnedPool {
 public:
  /// A buffer from the pool, returned to it when destroyed (or reset). Move-only; empty when the
  /// pool could not provide one. Not thread-safe itself (one owner at a time).
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& other) noexcept { *this = std::move(other); }
    Buffer& operator=(Buffer&& other) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { reset(); }

    explicit operator bool() const { return data_ != nullptr; }
    char* data() const { return static_cast<char*>(data_); }
    /// The size class: at least the size asked for.
    size_t capacity() const { return capacity_; }
    void reset();

   private:
    friend class PinnedPool;
    struct Core;  // pinned_pool.cc
    Buffer(std::shared_ptr<Core> core, void* data, size_t capacity)
        : core_(std::move(core)), data_(data), capacity_(capacity) {}
    std::shared_ptr<Core> core_;  // shared, not a PinnedPool*: the buffer may outlive the pool
    void* data_ = nullptr;
    size_t capacity_ = 0;
  };

  static absl::StatusOr<std::unique_ptr<PinnedPool>> Create(
      const PinnedPoolOptions& options, std::unique_ptr<HostAllocator> allocator);
  ~PinnedPool();  // frees the cached buffers

  /// A buffer of at least `bytes` (> 0), or an empty one when the cap (or the allocator) says no.
  Buffer Acquire(size_t bytes);
  /// The size class serving `bytes`; 0 if it is larger than any class the cap allows.
  size_t ClassSize(size_t bytes) const;
  /// Frees every cached (not handed out) buffer.
  void Trim();

  PinnedPoolStats stats() const;
  const PinnedPoolOptions& options() const;

 private:
  using Core = Buffer::Core;
  PinnedPool(const PinnedPoolOptions& options, std::unique_ptr<HostAllocator> allocator);

  // The allocator, free lists and stats: shared with every Buffer handed out, so that one returned
  // after the pool is destroyed still reaches the allocator.
  const std::shared_ptr<Core> core_;
};

}  // namespace flashserve
