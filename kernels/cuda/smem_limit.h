// Raising a kernel's dynamic shared-memory limit past 48 KB, once per (kernel, device): the
// attribute is per device, and setting it twice from racing threads is harmless.
// Internal linkage on purpose: a function-local static in a template is an STB_GNU_UNIQUE symbol,
// which glibc makes one object for the whole process, even across libraries opened RTLD_LOCAL.
// With two builds of the kernels loaded side by side (an A/B benchmark), the second build found
// the first one's bits set, skipped its own cudaFuncSetAttribute, and every launch needing more
// than 48 KB failed with cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace flashserve::kernels::cuda {
namespace {

/// Bit d set: Kernel's limit is raised on device d.
template <auto Kernel>
std::atomic<uint64_t> g_smem_limit_raised{0};

/// Makes the current device run Kernel with `bytes` of dynamic shared memory.
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (g_smem_limit_raised<Kernel>.load(std::memory_order_acquire) & bit) != 0)
    return cudaSuccess;
  if (cudaError_t err =
          cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      err != cudaSuccess)
    return err;
  g_smem_limit_raised<Kernel>.fetch_or(bit, std::memory_order_acq_rel);
  return cudaSuccess;
}

}  // namespace
}  // namespace flashserve::kernels::cuda
