// What the KV cache layer talks about: a sequence's shape, the page format derived from it, rows
// of K/V/Q as a client sent them, and one paged attention launch as a backend runs it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flashserve/kernels/dtype.h"

namespace flashserve::kvcache {

/// Fixed when a sequence is created; every later tensor must match it.
struct SequenceShape {
  int num_layers = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;
  kernels::DType dtype = kernels::DType::kFloat16;

  /// Bytes of one token's K (or V) in one layer: heads_kv * head_dim * element size.
  int64_t row_bytes() const { return int64_t(heads_kv) * head_dim * int64_t(dtype_size(dtype)); }
};

/// One page holds K and V of page_tokens tokens of one layer: K rows [page_tokens, heads_kv,
/// head_dim] at the page's offset, V rows the same at offset + v_offset. page_bytes is a power of
/// two (kvcache/page_allocator.h), so a launch addresses pages as base + index * page_bytes.
struct PageFormat {
  int page_tokens = 0;
  int64_t row_bytes = 0;
  int64_t v_offset = 0;    // = page_bytes / 2 >= page_tokens * row_bytes
  int64_t page_bytes = 0;  // next power of two of 2 * page_tokens * row_bytes, at least 256
};
PageFormat FormatFor(const SequenceShape& shape, int page_tokens);

/// Where a tensor's bytes live, as a KV store sees them (memory/tensor_bytes.h's MemoryKind, cut
/// to what a store needs: may it copy them with memcpy, or may its device address them).
enum class BytesAt {
  kHost,        // pageable host memory (the message, a heap buffer): the store copies it
  kPageLocked,  // page-locked host memory (a registered system region): a GPU store's device
                //   reads and writes it where it is (no staging copy); a CPU store as kHost
  kDevice,      // memory on the store's device (a client's CUDA region): a GPU store reads and
                //   writes it there; a CPU store refuses it
};

/// Rows of one tensor as the client sent them: [rows, heads, head_dim] of dtype, contiguous
/// (any alignment), in the memory `at` says. The edge checked that the bytes match the shape.
struct HostRows {
  kernels::DType dtype = kernels::DType::kFloat16;
  int64_t rows = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  const void* data = nullptr;
  BytesAt at = BytesAt::kHost;
};

/// K and V rows for one layer (k and v must have equal shapes).
struct LayerRows {
  int layer = 0;
  HostRows k, v;
  // >= 0: the layer's length before these rows as the client counts it (a retry-safe append,
  // sequences.proto LayerKV.expected_length); -1: not checked.
  int64_t expected_length = -1;
};

/// One sequence's part of a paged launch: q's rows are the last rows_q positions of `length`
/// keys, which live in `pages` (page indices: offset / page_bytes), in order.
struct PagedItem {
  const void* q = nullptr;  // [rows_q, heads_q, head_dim], any alignment, in q_at
  int rows_q = 0;
  void* out = nullptr;   // [rows_q, heads_q, head_dim], in out_at
  float* lse = nullptr;  // [heads_q, rows_q] or null, in lse_at
  BytesAt q_at = BytesAt::kHost, out_at = BytesAt::kHost, lse_at = BytesAt::kHost;
  std::vector<int32_t> pages;
  int64_t length = 0;
};

/// One launch: sequences of one shape and page format, one mask and scale.
struct PagedBatch {
  SequenceShape shape;  // num_layers unused
  PageFormat format;
  bool causal = false;
  float softmax_scale = 0.f;
  std::vector<PagedItem> items;
  // True once no call of the launch waits for its answer (each cancelled or past its deadline):
  // a store that can stop running work (the CPU's) polls it and returns CANCELLED. Thread-safe;
  // may be empty.
  std::function<bool()> stop;
};

/// What ran for one PagedBatch and, where the store can measure it, its device time.
struct AttendInfo {
  std::string kernel;
  int64_t h2d_us = 0;      // inputs to the device and rows into the pool (0: none)
  int64_t kernel_us = -1;  // the attention launch alone (-1: not measured)
  int64_t d2h_us = 0;      // outputs to where they go (host copy and/or in-place writes; 0: none)
  // The kernel read the queries / wrote the outputs where the items hold them (packed in item
  // order in memory the device addresses), without a gather or scatter.
  bool q_in_place = false, out_in_place = false;
};

}  // namespace flashserve::kvcache
