// Declaration of the per-configuration launchers and the macros that both declare (extern) and
// define each instantiation, so declarations and instance files cannot drift.
#pragma once

#include <cuda_runtime_api.h>

#include "flashserve/kernels/attention_params.h"
#include "kernel_traits.h"

namespace flashserve::kernels::cuda {

/// Launches flash_fwd_kernel<Traits, false> (fixed lengths) for p on stream; p must already be
/// supported (checked by the caller). Raises the dynamic shared-memory limit once per
/// instantiation and device.
template <typename Traits>
cudaError_t launch_fwd(const AttentionParams& p, cudaStream_t stream);

/// Same for packed variable-length sequences (p.cu_seqlens_q/k): flash_fwd_kernel<Traits, true>,
/// instantiated only for each head_dim's default configuration.
template <typename Traits>
cudaError_t launch_fwd_varlen(const AttentionParams& p, cudaStream_t stream);

}  // namespace flashserve::kernels::cuda

#define FLASHSERVE_FWD_TRAITS(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, Q_IN_REGS, \
                              LAZY_RESCALE)                                                  \
  FwdTraits<ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, Q_IN_REGS, LAZY_RESCALE>

// EXTERN is `extern` for a declaration, empty in the generated instance file that defines it.
#define FLASHSERVE_FWD_INSTANCE(EXTERN, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES,       \
                                Q_IN_REGS, LAZY_RESCALE)                                          \
  namespace flashserve::kernels::cuda {                                                           \
  EXTERN template cudaError_t                                                                     \
  launch_fwd<FLASHSERVE_FWD_TRAITS(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, Q_IN_REGS, \
                                   LAZY_RESCALE)>(const AttentionParams&, cudaStream_t);          \
  }
#define FLASHSERVE_FWD_VARLEN_INSTANCE(EXTERN, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, \
                                       Q_IN_REGS, LAZY_RESCALE)                                    \
  namespace flashserve::kernels::cuda {                                                            \
  EXTERN template cudaError_t launch_fwd_varlen<FLASHSERVE_FWD_TRAITS(                             \
      ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, Q_IN_REGS, LAZY_RESCALE)>(               \
      const AttentionParams&, cudaStream_t);                                                       \
  }
