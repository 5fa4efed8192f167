// Definition of decode_kernel<Element, kHeadDim, kWarpsM>(); included only by decode_d*.cu.
#pragma once

#include <atomic>
#include <cstdint>

#include "decode_kernel.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {

template <typename T>
cudaError_t launch_split(const DecodeLaunch& L, cudaStream_t stream) {
  auto kernel = decode_split_kernel<T>;
  // Bit d set: the >48 KB dynamic shared-memory attribute is raised on device d (as the
  // family's launch_fwd; racing threads setting it twice is harmless).
  static std::atomic<uint64_t> attribute_set{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (attribute_set.load(std::memory_order_acquire) & bit) == 0) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(T::kSmemBytes));
    if (err != cudaSuccess) return err;
    attribute_set.fetch_or(bit, std::memory_order_acq_rel);
  }
  const dim3 grid(L.num_splits, L.p.heads_kv * L.row_blocks, L.p.batch);
  return launch_decode_grid(kernel, grid, T::kThreads, T::kSmemBytes, L, stream);
}

/// Resident blocks per SM (0 on error), for the split heuristic; computed once per process.
template <typename T>
int split_blocks_per_sm() {
  static const int blocks = [] {
    int n = 0;
    if (cudaFuncSetAttribute(decode_split_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(T::kSmemBytes)) != cudaSuccess)
      return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_split_kernel<T>, T::kThreads,
                                                      T::kSmemBytes) != cudaSuccess)
      return 0;
    return n;
  }();
  return blocks;
}

template <typename Element, int kHeadDim, int kWarpsM>
DecodeKernel decode_kernel() {
  using T = DecodeTraits<Element, kHeadDim, kWarpsM>;
  DecodeKernel k;
  k.launch = &launch_split<T>;
  k.blocks_per_sm = &split_blocks_per_sm<T>;
  k.block_m = T::kBlockM;
  return k;
}

}  // namespace flashserve::kernels::cuda::decode
