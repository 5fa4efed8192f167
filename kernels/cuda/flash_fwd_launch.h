// Declaration of the per-configuration launcher and the one macro that both declares
// (extern) and defines each instantiation, so declarations and instance files cannot drift.
#pragma once

#include <cuda_runtime_api.h>

#include "flashserve/kernels/attention_params.h"
#include "kernel_traits.h"

namespace flashserve::kernels::cuda {

/// Launches flash_fwd_kernel<Traits> for p on stream; p must already be supported (checked by
/// the caller). Raises the dynamic shared-memory limit once per instantiation and device.
template <typename Traits>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream);

}  // namespace flashserve::kernels::cuda

// EXTERN is `extern` for a declaration, empty in the generated instance file that defines it.
#define FLASHSERVE_FWD_INSTANCE(EXTERN, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES,      \
                                Q_IN_REGS, LAZY_RESCALE)                                         \
  namespace flashserve::kernels::cuda {                                                          \
  EXTERN template cudaError_t launch_fwd<                                                        \
      FwdTraits<ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, Q_IN_REGS, LAZY_RESCALE>>(   \
      const AttentionParams&, cudaStream_t);                                                     \
  }
