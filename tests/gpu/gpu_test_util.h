// Shared by the GPU test binaries: GPU presence and what this build compiled.
#pragma once

#include <cuda_runtime_api.h>

#include "flashserve/kernels/cuda_attention.h"
#include "gtest/gtest.h"

namespace flashserve::kernels::testing_util {

inline bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

/// Whether kernels for (dtype, head_dim) were instantiated in this build.
inline bool compiled(DType dtype, int head_dim) {
  return !cuda::candidates(dtype, head_dim, false).empty();
}

}  // namespace flashserve::kernels::testing_util

#define SKIP_WITHOUT_GPU()                                                                   \
  if (!::flashserve::kernels::testing_util::gpu_available()) GTEST_SKIP() << "no CUDA GPU: " \
                                                                             "skipping"
