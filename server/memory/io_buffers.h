// Host memory holding one request's tensors from arrival to response: q | k | v | o | lse, each
// part 256-byte aligned (the CUDA backend mirrors the layout on the device, one allocation).
//
// An edge that parses requests itself copies the tensor bytes from gRPC's receive slices straight
// into these buffers (the only host copy on the way in) -- or, when the backend reads them in place
// from the receive arena, gets buffers with room for the outputs only -- and sends O and LSE out of
// them as slices (no copy on the way out). When the backend has a pinned staging pool the buffers come from it,
// so the GPU copies directly from and to them; otherwise they are ordinary heap memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "api/attention_problem.h"
#include "memory/pinned_pool.h"

namespace flashserve {

struct IoLayout {
  static constexpr size_t kAlign = 256;
  size_t q_bytes = 0, kv_bytes = 0, lse_bytes = 0;
  size_t k_offset = 0, v_offset = 0, o_offset = 0, lse_offset = 0, total = 0;

  static IoLayout For(const AttentionProblem& problem) {
    auto align = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    IoLayout l;
    l.q_bytes = size_t(problem.q_bytes());
    l.kv_bytes = size_t(problem.kv_bytes());
    l.lse_bytes = size_t(problem.lse_elements()) * sizeof(float);
    l.k_offset = align(l.q_bytes);
    l.v_offset = l.k_offset + align(l.kv_bytes);
    l.o_offset = l.v_offset + align(l.kv_bytes);
    l.lse_offset = l.o_offset + align(l.q_bytes);
    l.total = l.lse_offset + align(l.lse_bytes);
    return l;
  }
  /// Room for o | lse only (the inputs stay where they arrived): q/k/v offsets are 0, not usable.
  static IoLayout OutputsOnly(const AttentionProblem& problem) {
    IoLayout l = For(problem);
    const size_t inputs = l.o_offset;
    l.k_offset = l.v_offset = l.o_offset = 0;
    l.lse_offset -= inputs;
    l.total -= inputs;
    return l;
  }
};

/// One request's buffers. Not thread-safe; shared (shared_ptr) between the edge, the runtime and
/// the gRPC slices that send the output, and freed (or returned to the pool) by the last owner.
class IoBuffers {
 public:
  /// From the pool when it has room (pool may be null: the CUDA backend's pinned staging pool or
  /// the CPU backend's heap buffer pool), else freshly from the heap. nullptr only when the heap
  /// allocation fails.
  static std::shared_ptr<IoBuffers> Allocate(const AttentionProblem& problem, PinnedPool* pool);
  /// The same with room for the outputs only, for a backend that reads the inputs in place.
  static std::shared_ptr<IoBuffers> AllocateOutputs(const AttentionProblem& problem,
                                                    PinnedPool* pool);
  ~IoBuffers();
  IoBuffers(const IoBuffers&) = delete;
  IoBuffers& operator=(const IoBuffers&) = delete;

  const IoLayout& layout() const { return layout_; }
  /// False for AllocateOutputs buffers: q(), k(), v() must not be used.
  bool has_inputs() const { return has_inputs_; }
  /// Page-locked: from a pool whose memory the GPU can copy from directly.
  bool pinned() const { return pinned_ && page_locked_; }
  char* q() const { return base_; }
  char* k() const { return base_ + layout_.k_offset; }
  char* v() const { return base_ + layout_.v_offset; }
  char* o() const { return base_ + layout_.o_offset; }
  float* lse() const {
    return layout_.lse_bytes > 0 ? reinterpret_cast<float*>(base_ + layout_.lse_offset) : nullptr;
  }

 private:
  explicit IoBuffers(const IoLayout& layout) : layout_(layout) {}
  static std::shared_ptr<IoBuffers> AllocateLayout(const IoLayout& layout, PinnedPool* pool);
  const IoLayout layout_;
  PinnedPool::Buffer pinned_;  // from the pool (page-locked or not), else empty
  bool page_locked_ = false;
  char* base_ = nullptr;
  bool heap_ = false;
  bool has_inputs_ = true;
};

}  // namespace flashserve
