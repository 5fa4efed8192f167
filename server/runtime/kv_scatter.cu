#include "runtime/kv_scatter.h"

namespace flashserve {

namespace {

__global__ void KvScatterKernel(const KvScatterRange* ranges) {
  const KvScatterRange r = ranges[blockIdx.x];
  const uintptr_t misaligned = reinterpret_cast<uintptr_t>(r.dst) |
                               reinterpret_cast<uintptr_t>(r.src) | uintptr_t(r.bytes);
  if ((misaligned & 15) == 0) {
    const int64_t n = r.bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      reinterpret_cast<uint4*>(r.dst)[i] = reinterpret_cast<const uint4*>(r.src)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < r.bytes; i += blockDim.x) r.dst[i] = r.src[i];
  }
}

}  // namespace

cudaError_t LaunchKvScatter(const KvScatterRange* ranges, int count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  // 128 threads: a decode row is 2-8 KiB (128-512 16-byte moves).
  KvScatterKernel<<<count, 128, 0, stream>>>(ranges);
  return cudaGetLastError();
}

}  // namespace flashserve
