// Kernels that fault or hang on purpose, so tests can check how the server handles a sticky CUDA
// error (device marked unhealthy, readiness false) and a launch that never completes (a bounded
// shutdown) on real hardware. Only reachable through the server's --enable_fault_injection flag.
#include "flashserve/kernels/cuda_attention.h"

namespace flashserve::kernels::cuda {
namespace {

__global__ void trap_kernel() { __trap(); }

// Bounded, so that a test that goes wrong still gives its GPU back; %globaltimer counts ns.
__global__ void spin_kernel(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

cudaError_t launch_fault_for_testing(cudaStream_t stream) {
  trap_kernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t launch_hang_for_testing(cudaStream_t stream, int seconds) {
  spin_kernel<<<1, 1, 0, stream>>>(1000000000ull * unsigned(seconds));
  return cudaGetLastError();
}

}  // namespace flashserve::kernels::cuda
