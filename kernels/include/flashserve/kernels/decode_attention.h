// Decode attention for serving: few query rows per sequence (decode, speculative verification)
// against a long KV cache, dense or paged, fixed or variable lengths, with the key axis split over
// thread blocks (flash-decoding) and the query heads of one KV head packed into one block (GQA).
// Nothing here throws.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flashserve/kernels/dtype.h"

namespace flashserve::kernels::cuda {

/// One decode problem. Sizes per sequence b in [0, batch):
///   Sq_b = cu_seqlens_q ? cu_seqlens_q[b+1] - cu_seqlens_q[b] : seqlen_q
///   Sk_b = seqlens_k ? seqlens_k[b] : cu_seqlens_k ? cu_seqlens_k[b+1] - cu_seqlens_k[b] :
///   seqlen_k
/// Query rows (q, o):
///   fixed (cu_seqlens_q null): row i of sequence b at b * q_batch_stride + i * q_row_stride
///   varlen: packed [total_q, heads, head_dim], row at (cu_seqlens_q[b] + i) * q_row_stride
///   (+ head * q_head_stride; o likewise with its own strides).
/// Keys/values (k, v; same layout for both, own strides):
///   dense fixed:  key j of sequence b at b * k_batch_stride + j * k_row_stride
///   dense varlen (cu_seqlens_k): packed, key j at (cu_seqlens_k[b] + j) * k_row_stride
///   paged (block_table): a pool [num_pages, page_size, heads_kv, head_dim]; key j of sequence b
///     lives in page block_table[b * block_table_stride + j / page_size] at row j % page_size;
///     page p starts at p * k_batch_stride (the page stride). seqlens_k is required, and
///     seqlen_k (bounding every Sk_b) at most block_table_stride * page_size: rows are read
///     unbounded, a longer sequence would read the next one's pages.
/// LSE (natural log, fp32, may be null): fixed [batch, heads_q, seqlen_q] contiguous;
/// varlen [heads_q, total_q] contiguous. A row that sees no key gets O = 0, LSE = -inf.
/// Causal masking is bottom-right per sequence: row i sees key j iff j <= i + Sk_b - Sq_b.
/// Query head h reads KV head h / (heads_q / heads_kv). Strides in elements; head_dim contiguous.
struct DecodeParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  const int32_t* cu_seqlens_q = nullptr;  // [batch + 1] device, or null (fixed seqlen_q)
  const int32_t* cu_seqlens_k = nullptr;  // [batch + 1] device, dense K/V only, or null
  const int32_t* seqlens_k = nullptr;     // [batch] device; required when paged
  const int32_t* block_table = nullptr;   // [batch, block_table_stride] device; null: dense
  int64_t block_table_stride = 0;         // entries per sequence (>= seqlen_k / page_size)
  int page_size = 0;                      // keys per page (paged only), any value >= 1

  int batch = 0;
  int seqlen_q = 0;  // fixed: every sequence's Sq; varlen: max over sequences (an upper bound
                     // rows are sized by: with total_q > 0, >= 1 and >= total_q / batch)
  int seqlen_k = 0;  // fixed dense: Sk; otherwise an upper bound on every Sk_b (split sizing)
  int total_q = 0;   // varlen only: cu_seqlens_q[batch] (rows of q, o, lse)
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;

  float softmax_scale = 0.f;
  bool causal = false;
  DType dtype = DType::kFloat16;

  /// Key-axis splits per (sequence, KV head): 0 = heuristic (decode_num_splits), else 1..128.
  int num_splits = 0;
  /// Scratch for split partials (decode_workspace_bytes), 256-byte aligned (refused otherwise).
  /// When null and more than one split runs, run_decode allocates it stream-ordered
  /// (cudaMallocAsync) and frees it.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

/// Fills sizes, scale and contiguous dense strides: q/o [batch, seqlen_q, heads_q, head_dim],
/// k/v [batch, seqlen_k, heads_kv, head_dim]. Pointers, varlen and paging are left unset.
DecodeParams make_dense_decode_params(DType dtype, int batch, int seqlen_q, int seqlen_k,
                                      int heads_q, int heads_kv, int head_dim, bool causal,
                                      float softmax_scale);

/// Head dims the decode kernels are compiled for (32, 64, 96, 128, 256).
std::vector<int> decode_head_dims();

/// Empty when run_decode can run p; otherwise a message naming the offending field.
/// Checks dtype, head_dim, sizes (varlen: seqlen_q against total_q), GQA divisibility, 16-byte
/// alignment (workspace: 256), paging fields (seqlen_k within one block-table row's pages), grid
/// limits. Does not touch the GPU (does not read the device-side length arrays).
std::string decode_supported(const DecodeParams& p);

/// Splits the heuristic picks for p on a GPU with sm_count SMs: enough blocks for about full
/// waves (planned at two resident blocks per SM, one for the d128 kernel on sm_90's whole-tile
/// TMA loads), each split at least a few key tiles long. Depends on the layout (dense, page
/// size) and the device: size a workspace from the same p that runs.
int decode_num_splits(const DecodeParams& p, int sm_count);

/// The autotuner's search space over split counts for p on sm_count SMs: 1, the heuristic's
/// choice, and the counts that fill 1, 2 and 4 waves of resident blocks, each kept only if the
/// sequence (p.seqlen_k) has at least one key tile per split; ascending, no duplicates. Time
/// run_decode with p.num_splits set to each and keep the fastest.
std::vector<int> decode_split_candidates(const DecodeParams& p, int sm_count);

/// Bytes of workspace for p with num_splits splits (0 when num_splits <= 1).
size_t decode_workspace_bytes(const DecodeParams& p, int num_splits);

/// Queues the decode attention for p on stream: the split kernel, and when the key axis is split
/// and the partials are too large to merge in the split kernel's last block per group, a combine
/// kernel. Small merges count on per-device counters that every completed launch leaves at zero;
/// a set of them passes from one stream to another only once an event says its last launch has
/// ended (otherwise, and during stream capture, the combine kernel runs). Thread-safe as far as
/// that bookkeeping goes. Returns cudaErrorInvalidValue when decode_supported(p) is not empty or
/// p.workspace is too small; otherwise the launches' error.
cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream);

}  // namespace flashserve::kernels::cuda
