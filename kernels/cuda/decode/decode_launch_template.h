// Definition of decode_kernel<Element, kHeadDim, kWarpsM, kBlockN, kStages>(); included only by
// decode_d*.cu.
#pragma once

#include "../smem_limit.h"
#include "decode_kernel.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {

template <typename T>
cudaError_t launch_split(const DecodeLaunch& L, cudaStream_t stream) {
  constexpr auto kernel = decode_split_kernel<T>;
  if (cudaError_t err = raise_smem_limit<kernel>(int(T::kSmemBytes)); err != cudaSuccess)
    return err;
  const dim3 grid(L.num_splits, L.p.heads_kv * L.row_blocks, L.p.batch);
  return launch_decode_grid(kernel, grid, T::kThreads, T::kSmemBytes, L, stream);
}

namespace {  // internal linkage: one answer per build loaded, not per process (smem_limit.h)
/// Resident blocks per SM (0 on error), for the split heuristic; computed once.
template <typename T>
int split_blocks_per_sm() {
  static const int blocks = [] {
    int n = 0;
    if (raise_smem_limit<decode_split_kernel<T>>(int(T::kSmemBytes)) != cudaSuccess) return 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_split_kernel<T>, T::kThreads,
                                                      T::kSmemBytes) != cudaSuccess)
      return 0;
    return n;
  }();
  return blocks;
}
}  // namespace

template <typename Element, int kHeadDim, int kWarpsM, int kBlockN, int kStages>
DecodeKernel decode_kernel() {
  using T = DecodeTraits<Element, kHeadDim, kWarpsM, kBlockN, kStages>;
  DecodeKernel k;
  k.launch = &launch_split<T>;
  k.blocks_per_sm = &split_blocks_per_sm<T>;
  k.block_m = T::kBlockM;
  k.block_n = T::kBlockN;
  k.stages = T::kStages;
  k.has_tma = T::kHasTma;
  k.smem_bytes = T::kSmemBytes;
  return k;
}

}  // namespace flashserve::kernels::cuda::decode
