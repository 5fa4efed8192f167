// TMA tensor maps for the sm90 kernels, built on the host per launch.
// cuTensorMapEncodeTiled is a driver-API function; it is looked up at run time through
// cudaGetDriverEntryPointByVersion so that nothing links libcuda (the library links only the
// static CUDA runtime, as before; the driver is loaded by the runtime anyway).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/dtype.h"

namespace flashserve::kernels::cuda::sm90 {

/// One operand as TMA sees it: [batch][heads][seqlen][head_dim] (innermost last) with element
/// strides; boxes of [box_rows][64] elements, 128-byte swizzled, zero-filled out of bounds.
struct TensorView {
  const void* base;
  DType dtype;
  int head_dim, seqlen, heads, batch;
  int64_t row_stride, head_stride, batch_stride;
};

/// One operand of p: `rows` per sequence (seqlen_q or seqlen_k) of a [batch] tensor, or, with
/// packed variable-length inputs, `packed_rows` (total_q or total_k) of one batch; each tile then
/// adds its sequence's first row (BlockWork).
inline TensorView operand_view(const AttentionParams& p, const void* base, int rows,
                               int packed_rows, int heads, int64_t row_stride, int64_t head_stride,
                               int64_t batch_stride) {
  const bool packed = p.varlen();
  return {base,        p.dtype,
          p.head_dim,  packed ? packed_rows : rows,
          heads,       packed ? 1 : p.batch,
          row_stride,  head_stride,
          batch_stride};
}

/// The views of p's q, k and v (read by TMA loads).
inline TensorView q_view(const AttentionParams& p) {
  return operand_view(p, p.q, p.seqlen_q, p.total_q, p.heads_q, p.q_row_stride, p.q_head_stride,
                      p.q_batch_stride);
}
inline TensorView k_view(const AttentionParams& p) {
  return operand_view(p, p.k, p.seqlen_k, p.total_k, p.heads_kv, p.k_row_stride, p.k_head_stride,
                      p.k_batch_stride);
}
inline TensorView v_view(const AttentionParams& p) {
  return operand_view(p, p.v, p.seqlen_k, p.total_k, p.heads_kv, p.v_row_stride, p.v_head_stride,
                      p.v_batch_stride);
}

/// The view of p's output o (TMA stores; packed rows crossing a sequence's end go row by row).
inline TensorView o_view(const AttentionParams& p) {
  return operand_view(p, p.o, p.seqlen_q, p.total_q, p.heads_q, p.o_row_stride, p.o_head_stride,
                      p.o_batch_stride);
}

/// cudaSuccess, or cudaErrorInvalidValue when the view cannot be a tensor map (e.g. a zero or
/// negative stride over more than one row/head/batch), or the driver lookup's error.
cudaError_t make_tensor_map(const TensorView& view, int box_rows, CUtensorMap* map);

/// Whether make_tensor_map accepts these strides (the host-side part of sm90 support).
bool tensor_map_strides_ok(const TensorView& view);

}  // namespace flashserve::kernels::cuda::sm90
