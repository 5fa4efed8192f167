// launch_sm90<Traits>: builds the Q/K/V tensor maps and launches sm90_fwd_kernel. Included only
// by the instance files (compiled for sm_90a); the dispatch table sees registry.h.
#pragma once

#include <atomic>
#include <cstdint>

#include "kernel.h"
#include "registry.h"
#include "tensor_map.h"

namespace flashserve::kernels::cuda::sm90 {

template <typename T>
cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = sm90_fwd_kernel<T>;
  // Bit d: the >48 KB dynamic shared-memory limit is raised on device d (per-device attribute).
  static std::atomic<uint64_t> attribute_set{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (attribute_set.load(std::memory_order_acquire) & bit) == 0) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(T::kSmemBytes));
        err != cudaSuccess)
      return err;
    attribute_set.fetch_or(bit, std::memory_order_acq_rel);
  }
  CUtensorMap tm_q, tm_k, tm_v;
  const TensorView q{p.q, p.dtype, p.head_dim, p.seqlen_q, p.heads_q, p.batch,
                     p.q_row_stride, p.q_head_stride, p.q_batch_stride};
  const TensorView k{p.k, p.dtype, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                     p.k_row_stride, p.k_head_stride, p.k_batch_stride};
  const TensorView v{p.v, p.dtype, p.head_dim, p.seqlen_k, p.heads_kv, p.batch,
                     p.v_row_stride, p.v_head_stride, p.v_batch_stride};
  if (cudaError_t err = make_tensor_map(q, T::kBlockM, &tm_q); err != cudaSuccess) return err;
  if (cudaError_t err = make_tensor_map(k, T::kBlockN, &tm_k); err != cudaSuccess) return err;
  if (cudaError_t err = make_tensor_map(v, T::kBlockN, &tm_v); err != cudaSuccess) return err;
  const dim3 grid((p.seqlen_q + T::kBlockM - 1) / T::kBlockM, p.heads_q, p.batch);
  kernel<<<grid, T::kNThreads, T::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v);
  return cudaGetLastError();
}

}  // namespace flashserve::kernels::cuda::sm90
