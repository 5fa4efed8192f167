// The compiled sm90 configurations (instances/*.cu), seen by the dispatch table
// (flash_fwd_dispatch.cu). Plain host declarations: no sm_90a code is needed to include it.
// X(DTYPE, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES): one instance per line; only what
// select()/candidates() can pick is instantiated (each instance costs build time). The first
// line for a (dtype, head_dim) is the family's default there. Three K/V stages (H100 run 4:
// within +-3% of two, no pattern) are not instantiated; block_n 176 only for d=128, block_n 192
// only for d=64 (a candidate for the autotuner; dispatch picks 128 there); d=256 takes 64-key
// steps (one Q buffer: 64 KB of Q + 128 KB of K/V stages). d=96 and d=32 run the d=128 and
// d=64 instances (kernel_head_dim): TMA zero-fills the columns past head_dim on load and clips
// them on store, so they cost tensor-core work but no memory traffic and no extra build.
#pragma once

#include <cuda_runtime_api.h>

#include "flashserve/kernels/attention_params.h"

#define FLASHSERVE_SM90_CONFIGS(X)              \
  X(kFloat16, __half, 64, 128, 128, 2)          \
  X(kBFloat16, __nv_bfloat16, 64, 128, 128, 2)  \
  X(kFloat16, __half, 128, 128, 128, 2)         \
  X(kBFloat16, __nv_bfloat16, 128, 128, 128, 2) \
  X(kFloat16, __half, 128, 128, 176, 2)         \
  X(kBFloat16, __nv_bfloat16, 128, 128, 176, 2) \
  X(kFloat16, __half, 64, 128, 192, 2)          \
  X(kBFloat16, __nv_bfloat16, 64, 128, 192, 2)  \
  X(kFloat16, __half, 64, 192, 128, 2)          \
  X(kBFloat16, __nv_bfloat16, 64, 192, 128, 2)  \
  X(kFloat16, __half, 256, 128, 64, 2)          \
  X(kBFloat16, __nv_bfloat16, 256, 128, 64, 2)  \
  X(kFloat16, __half, 96, 128, 128, 2)          \
  X(kBFloat16, __nv_bfloat16, 96, 128, 128, 2)  \
  X(kFloat16, __half, 32, 128, 128, 2)          \
  X(kBFloat16, __nv_bfloat16, 32, 128, 128, 2)  \
  X(kFloat16, __half, 32, 192, 128, 2)          \
  X(kBFloat16, __nv_bfloat16, 32, 192, 128, 2)

namespace flashserve::kernels::cuda::sm90 {

/// The instance's head dim for a problem's: a multiple of 64 (the 128-byte swizzled column block).
constexpr int kernel_head_dim(int head_dim) { return (head_dim + 63) / 64 * 64; }

// kPacked_: the kernel for packed variable-length inputs (launch_sm90 picks it at run time).
template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_,
          bool kPacked_ = false>
struct Sm90Traits;

template <typename T>
cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream);

}  // namespace flashserve::kernels::cuda::sm90
