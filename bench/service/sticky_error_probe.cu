// After a sticky CUDA error on device 0 (a trap kernel), can device 1 still be used -- from the thread that saw the
// error, from another thread? The CUDA backend's fault handling rests on the answer: on two H200s (CUDA 13.0) every
// call on device 1 failed with the same error from every thread, so a sticky error stops the whole server
// (bench/results/service-h100-h200x2-2026-11-22.md). Needs two GPUs.
// Build and run: nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/sticky sticky_error_probe.cu && /tmp/sticky
#include <cuda_runtime.h>
#include <cstdio>
#include <thread>
__global__ void trap_kernel() { asm volatile("trap;"); }
__global__ void ok_kernel(int* p) { p[threadIdx.x] = threadIdx.x; }
static void P(const char* what, cudaError_t e) { std::printf("%-52s %s\n", what, cudaGetErrorString(e)); }
static void use_device1(const char* who, cudaStream_t s1) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "%s: cudaSetDevice(1)", who); P(buf, cudaSetDevice(1));
  int* p = nullptr;
  std::snprintf(buf, sizeof buf, "%s: cudaMallocAsync on dev1 stream", who);
  P(buf, cudaMallocAsync(reinterpret_cast<void**>(&p), 1 << 20, s1));
  ok_kernel<<<1, 32, 0, s1>>>(p);
  std::snprintf(buf, sizeof buf, "%s: launch on dev1", who); P(buf, cudaGetLastError());
  std::snprintf(buf, sizeof buf, "%s: sync dev1 stream", who); P(buf, cudaStreamSynchronize(s1));
  std::snprintf(buf, sizeof buf, "%s: cudaFreeAsync", who); P(buf, cudaFreeAsync(p, s1));
}
int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::printf("needs two CUDA devices, found %d\n", count);
    return 1;
  }
  cudaStream_t s0, s1, s1b;
  cudaSetDevice(1);
  cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&s1b, cudaStreamNonBlocking);
  use_device1("before", s1);
  cudaSetDevice(0);
  cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking);
  trap_kernel<<<1, 1, 0, s0>>>();
  P("fault: sync dev0 stream", cudaStreamSynchronize(s0));
  P("fault: cudaGetLastError", cudaGetLastError());
  use_device1("same thread", s1);
  std::thread([&] { use_device1("other thread", s1b); }).join();
  std::thread([&] { cudaSetDevice(0); P("other thread: cudaSetDevice(0) + cudaFree(0)", cudaFree(0)); }).join();
  return 0;
}
