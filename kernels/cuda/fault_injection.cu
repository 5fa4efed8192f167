// A kernel that faults on purpose, so tests can check how the server handles a sticky CUDA error
// (device marked unhealthy, readiness false) on real hardware. Only reachable through the
// server's --enable_fault_injection test flag.
#include "flashserve/kernels/cuda_attention.h"

namespace flashserve::kernels::cuda {
namespace {

__global__ void trap_kernel() { __trap(); }

}  // namespace

cudaError_t launch_fault_for_testing(cudaStream_t stream) {
  trap_kernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace flashserve::kernels::cuda
