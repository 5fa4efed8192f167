// Where a block's sequence lives: batch b of fixed-length [batch, seqlen, heads, d] tensors, or
// sequence b of packed variable-length ones (AttentionParams::cu_seqlens_q/k). A compile-time
// choice: the fixed-length kernels see only the params' constant bank (as before varlen existed:
// merging in the loaded varlen offsets at run time cost the d=128 kernels 12-68 B of spills), and
// variable lengths are a separate instantiation (kernels/tools/generate_instances.py).
#pragma once

#include <cstdint>

#include "flashserve/kernels/attention_params.h"

namespace flashserve::kernels::cuda {

/// One (sequence, query head): its lengths and the element offsets of its first row in q, k, v,
/// o (head offset not included) and of its first LSE entry (LSE [batch, heads_q, seqlen_q], or
/// [heads_q, total_q] with variable lengths).
struct SequenceView {
  int seqlen_q, seqlen_k;
  int64_t q_offset, k_offset, v_offset, o_offset, lse_offset;
};

template <bool kVarlen>
__device__ __forceinline__ SequenceView sequence_view(const AttentionParams& p, int b, int head) {
  if constexpr (!kVarlen) {
    return {p.seqlen_q,
            p.seqlen_k,
            b * p.q_batch_stride,
            b * p.k_batch_stride,
            b * p.v_batch_stride,
            b * p.o_batch_stride,
            (int64_t(b) * p.heads_q + head) * p.seqlen_q};
  } else {
    const int q0 = p.cu_seqlens_q[b], k0 = p.cu_seqlens_k[b];
    return {p.cu_seqlens_q[b + 1] - q0,    p.cu_seqlens_k[b + 1] - k0, q0 * p.q_row_stride,
            k0 * p.k_row_stride,           k0 * p.v_row_stride,        q0 * p.o_row_stride,
            int64_t(head) * p.total_q + q0};
  }
}

}  // namespace flashserve::kernels::cuda
