// A validated attention request: sizes and options. Where its tensors' bytes are is said apart
// (memory/tensor_bytes.h).
#pragma once

#include <cstdint>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/dtype.h"

namespace flashserve {

struct AttentionProblem {
  kernels::DType dtype = kernels::DType::kFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  bool causal = false;
  float softmax_scale = 0.f;
  bool return_lse = false;
  int64_t q_elements() const { return int64_t{batch} * seqlen_q * heads_q * head_dim; }
  int64_t kv_elements() const { return int64_t{batch} * seqlen_k * heads_kv * head_dim; }
  int64_t q_bytes() const { return q_elements() * int64_t(kernels::dtype_size(dtype)); }
  int64_t kv_bytes() const { return kv_elements() * int64_t(kernels::dtype_size(dtype)); }
  int64_t out_bytes() const { return q_bytes(); }
  int64_t lse_elements() const { return return_lse ? int64_t{batch} * heads_q * seqlen_q : 0; }

  /// Params with contiguous strides; the caller sets q/k/v/o/lse pointers for its memory.
  kernels::AttentionParams params() const {
    return kernels::make_contiguous_params(dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                                           head_dim, causal, softmax_scale);
  }
};

}  // namespace flashserve
