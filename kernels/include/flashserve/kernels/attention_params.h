// The one runtime description of a forward attention problem, shared by the CPU
// backend and the CUDA kernels (passed to the kernels by value as __grid_constant__).
#pragma once

#include <cmath>
#include <cstdint>

#include "flashserve/kernels/dtype.h"

namespace flashserve::kernels {

/// Forward attention O = softmax(scale * Q K^T + mask) V, per (batch, head).
///   q:   [batch, seqlen_q, heads_q,  head_dim]
///   k,v: [batch, seqlen_k, heads_kv, head_dim]
///   o:   [batch, seqlen_q, heads_q,  head_dim]  (same dtype as q)
///   lse: [batch, heads_q, seqlen_q] float32, contiguous; nullptr when not wanted.
/// Query head h reads key/value head h / (heads_q / heads_kv) (GQA/MQA).
/// Causal masking is aligned bottom-right (FlashAttention-2 >= 2.1): query row i may
/// attend key column j iff j <= i + seqlen_k - seqlen_q. A row that can attend no
/// key (possible when seqlen_q > seqlen_k) gets O = 0 and LSE = -inf.
/// Strides are in elements; the last (head_dim) dimension is contiguous.
///
/// Variable lengths (only cuda::run() reads these fields; the CPU backend and the references do
/// not look at them): with
/// cu_seqlens_q and cu_seqlens_k set, sequence b's queries are rows [cu_seqlens_q[b],
/// cu_seqlens_q[b+1]) of a packed q/o [total_q, heads_q, head_dim] and its keys rows
/// [cu_seqlens_k[b], cu_seqlens_k[b+1]) of a packed k/v [total_k, heads_kv, head_dim] (both
/// int32 [batch + 1], non-decreasing, in device memory; batch strides are ignored). seqlen_q and
/// seqlen_k are then the maxima over the sequences (the grid is sized by them; a longer sequence
/// is the caller's bug; with total_q > 0, seqlen_q >= 1 and batch * seqlen_q >= total_q are
/// checked), causal is bottom-right per sequence, and lse is [heads_q, total_q].
/// The sm90 family also needs total_k (its TMA tensor maps span the packed k/v); without it
/// packed inputs run on the sm80 family.
struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;

  float softmax_scale = 0.f;       // applied to Q K^T
  float softmax_scale_log2 = 0.f;  // softmax_scale * log2(e) to float rounding (checked: O uses
                                   // this one, the LSE softmax_scale)
  bool causal = false;
  DType dtype = DType::kFloat16;

  const int* cu_seqlens_q = nullptr;  // variable lengths (above): both set, or both null
  const int* cu_seqlens_k = nullptr;
  int total_q = 0;                    // rows of the packed q/o (sizes the varlen lse)
  int total_k = 0;                    // rows of the packed k/v (0: unknown, sm80 family only)

  bool varlen() const { return cu_seqlens_q != nullptr || cu_seqlens_k != nullptr; }
};

/// Fills sizes, scale and contiguous [batch, seqlen, heads, head_dim] strides.
/// softmax_scale <= 0 or NaN is the caller's bug; pass 1/sqrt(head_dim) for the default.
inline AttentionParams make_contiguous_params(DType dtype, int batch, int seqlen_q, int seqlen_k,
                                              int heads_q, int heads_kv, int head_dim,
                                              bool causal, float softmax_scale) {
  AttentionParams p;
  p.dtype = dtype;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.causal = causal;
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = softmax_scale * 1.4426950408889634f;
  p.q_head_stride = head_dim;
  p.q_row_stride = int64_t{heads_q} * head_dim;
  p.q_batch_stride = p.q_row_stride * seqlen_q;
  p.o_head_stride = p.q_head_stride;
  p.o_row_stride = p.q_row_stride;
  p.o_batch_stride = p.q_batch_stride;
  p.k_head_stride = head_dim;
  p.k_row_stride = int64_t{heads_kv} * head_dim;
  p.k_batch_stride = p.k_row_stride * seqlen_k;
  p.v_head_stride = p.k_head_stride;
  p.v_row_stride = p.k_row_stride;
  p.v_batch_stride = p.k_batch_stride;
  return p;
}

/// 4 * batch * heads_q * seqlen_q * seqlen_k * head_dim, halved for causal when
/// seqlen_q == seqlen_k (the convention of FlashAttention's benchmarks).
inline double attention_flops(const AttentionParams& p) {
  double flops = 4.0 * p.batch * p.heads_q * double(p.seqlen_q) * p.seqlen_k * p.head_dim;
  return (p.causal && p.seqlen_q == p.seqlen_k) ? flops / 2 : flops;
}

}  // namespace flashserve::kernels
