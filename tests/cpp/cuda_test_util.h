// What the server's CUDA tests (label "gpu") ask before they run: is there a GPU, and was the
// decode kernel built for a head dim.
#pragma once

#include <cuda_runtime_api.h>

#include "flashserve/kernels/decode_attention.h"

namespace flashserve::cuda_testing {

/// Whether a CUDA device is visible (a failed query is cleared: no GPU is not an error here).
inline bool GpuAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

/// Whether the decode kernels were compiled for head_dim (FLASHSERVE_KERNEL_HEAD_DIMS).
inline bool DecodeHeadDimCompiled(int head_dim) {
  for (int d : kernels::cuda::decode_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

}  // namespace flashserve::cuda_testing
