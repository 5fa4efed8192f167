// How fast this GPU's DRAM can be read at all: a streaming read of a buffer far larger than L2
// (16-byte non-coherent loads, several in flight per thread, every byte read once per pass),
// over grids of 1..8 blocks per SM. The decode tables compare their K/V bytes per second with
// the datasheet peak; this says how much of that peak any kernel reaches on the same GPU.
//
//   nvcc -O3 -arch=sm_90 -o read_bandwidth bench/kernels/read_bandwidth.cu
//   ./read_bandwidth [GiB, default 2] [reps, default 20]
//
// Prints one line per grid: median / best seconds per pass and TB/s (10^12 bytes per second).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kUnroll = 8;  // 16-byte loads in flight per thread

__global__ void read_kernel(const int4* __restrict__ data, int64_t n, int* __restrict__ sink) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  int acc = 0;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const int4 v = __ldg(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x7fffffff) *sink = acc;  // keeps the loads; the buffer holds no such pattern
}

#define CHECK(call)                                                             \
  do {                                                                          \
    const cudaError_t e = (call);                                               \
    if (e != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e));           \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const double gib = argc > 1 ? std::atof(argv[1]) : 2.0;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
  const int64_t bytes = int64_t(gib * (1 << 30)) / 16 * 16;
  const int64_t n = bytes / 16;
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int4* data = nullptr;
  int* sink = nullptr;
  CHECK(cudaMalloc(&data, size_t(bytes)));
  CHECK(cudaMalloc(&sink, sizeof(int)));
  CHECK(cudaMemset(data, 0x11, size_t(bytes)));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::printf("%s, %d SMs, %.2f GiB buffer, %d reps per grid\n", prop.name,
              prop.multiProcessorCount, gib, reps);
  std::printf("| blocks per SM | threads | median ms | best ms | median TB/s | best TB/s |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (int threads : {256, 512, 1024}) {
    for (int per_sm : {1, 2, 4, 8}) {
      if (threads * per_sm > prop.maxThreadsPerMultiProcessor) continue;
      const int blocks = per_sm * prop.multiProcessorCount;
      for (int w = 0; w < 3; ++w) read_kernel<<<blocks, threads>>>(data, n, sink);
      std::vector<float> ms;
      for (int r = 0; r < reps; ++r) {
        CHECK(cudaEventRecord(start));
        read_kernel<<<blocks, threads>>>(data, n, sink);
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t = 0.f;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double median = ms[ms.size() / 2], best = ms.front();
      std::printf("| %d | %d | %.4f | %.4f | %.3f | %.3f |\n", per_sm, threads, median, best,
                  bytes / median / 1e9, bytes / best / 1e9);
    }
  }
  CHECK(cudaFree(data));
  CHECK(cudaFree(sink));
  return 0;
}
