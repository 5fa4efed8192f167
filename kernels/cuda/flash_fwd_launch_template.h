// Definition of launch_fwd<Traits>; included only by the generated instance files.
#pragma once

#include "flash_fwd_kernel.h"
#include "flash_fwd_launch.h"
#include "smem_limit.h"

namespace flashserve::kernels::cuda {

template <typename Traits, bool kVarlen>
cudaError_t launch_fwd_impl(const AttentionParams& p, cudaStream_t stream) {
  constexpr auto kernel = flash_fwd_kernel<Traits, kVarlen>;
  if (cudaError_t err = raise_smem_limit<kernel>(int(Traits::kSmemBytes)); err != cudaSuccess)
    return err;
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
