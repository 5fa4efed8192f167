// Raising a kernel's dynamic shared-memory limit past 48 KB, once per (kernel, context): the
// attribute belongs to the kernel in one context, so after a cudaDeviceReset (a new context) it
// is set again; setting it twice from racing threads is harmless.
// Internal linkage on purpose: a function-local static in a template is an STB_GNU_UNIQUE symbol,
// which glibc makes one object for the whole process, even across libraries opened RTLD_LOCAL.
// With two builds of the kernels loaded side by side (an A/B benchmark), the second build found
// the first one's bits set, skipped its own cudaFuncSetAttribute, and every launch needing more
// than 48 KB failed with cudaErrorInvalidValue.
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "context_id.h"

namespace flashserve::kernels::cuda {
namespace {

constexpr int kSmemLimitDevices = 64;

/// Per device: the id of the context in which Kernel's limit is raised (0: none).
template <auto Kernel>
std::atomic<unsigned long long> g_smem_limit_context[kSmemLimitDevices]{};

/// Makes the current device run Kernel with `bytes` of dynamic shared memory.
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kSmemLimitDevices;
  if (cached) {
    const unsigned long long ctx = current_context_id();
    if (ctx != 0 && g_smem_limit_context<Kernel>[device].load(std::memory_order_acquire) == ctx)
      return cudaSuccess;
  }
  if (cudaError_t err =
          cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      err != cudaSuccess)
    return err;
  // Read after the call: the context may only exist since it.
  if (cached)
    g_smem_limit_context<Kernel>[device].store(current_context_id(), std::memory_order_release);
  return cudaSuccess;
}

}  // namespace
}  // namespace flashserve::kernels::cuda
