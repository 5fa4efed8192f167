// Definition of launch_fwd<Traits>; included only by the generated instance files.
#pragma once

#include <atomic>
#include <cstdint>

#include "flash_fwd_kernel.h"
#include "flash_fwd_launch.h"

namespace flashserve::kernels::cuda {

template <typename Traits, bool kVarlen>
cudaError_t launch_fwd_impl(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = flash_fwd_kernel<Traits, kVarlen>;
  // Bit d set: the >48 KB dynamic shared-memory attribute is raised on device d (the attribute
  // is per device; setting it twice from racing threads is harmless).
  static std::atomic<uint64_t> attribute_set{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (attribute_set.load(std::memory_order_acquire) & bit) == 0) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(Traits::kSmemBytes));
    if (err != cudaSuccess) return err;
    attribute_set.fetch_or(bit, std::memory_order_acq_rel);
  }
  // Variable lengths: seqlen_q is the longest sequence, batch the number of sequences.
  const dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename Traits>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream) {
  return launch_fwd_impl<Traits, false>(p, stream);
}

template <typename Traits>
cudaError_t launch_fwd_varlen(const AttentionParams& p, cudaStream_t stream) {
  return launch_fwd_impl<Traits, true>(p, stream);
}

}  // namespace flashserve::kernels::cuda
