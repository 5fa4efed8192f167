// launch_sm90<Traits>: builds the Q/K/V tensor maps and launches sm90_fwd_kernel. Included only
// by the instance files (compiled for sm_90a); the dispatch table sees registry.h.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>

#include "kernel.h"
#include "registry.h"
#include "tensor_map.h"

namespace flashserve::kernels::cuda::sm90 {

/// Blocks of the grid. Persistent (one block per SM, each walking a static list of tiles, the
/// producer prefetching the next tile during the current one's last GEMM and epilogue) except
/// for long causal problems, where tiles differ most in weight and the hardware's greedy
/// block-by-block scheduling balances better than the static list (one block per tile, the
/// heaviest first): H100, bench/results/kernels-sm90-h100-2026-11-24.md, causal d128 S16k
/// 602 vs 505 TFLOPS; S <= 4k: persistent equal or up to 1.3x faster.
/// For persistent causal grids, a block count coprime with the tiles per head makes each
/// block's tiles b, b + grid, ... cycle through every weight.
inline int grid_blocks(const AttentionParams& p, int tiles, int tiles_per_head, int sm_count) {
  if (p.causal && int64_t(p.seqlen_q) * p.head_dim >= 8192 * 128) return tiles;
  int grid = std::min(tiles, std::max(sm_count, 1));
  if (p.causal)
    while (grid > 1 && std::gcd(grid, tiles_per_head) != 1) --grid;
  return grid;
}

template <typename T>
cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream) {
  auto kernel = sm90_fwd_kernel<T>;
  // Bit d: the >48 KB dynamic shared-memory limit is raised on device d (per-device attribute).
  static std::atomic<uint64_t> attribute_set{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (attribute_set.load(std::memory_order_acquire) & bit) == 0) {
    if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(T::kSmemBytes));
        err != cudaSuccess)
      return err;
    attribute_set.fetch_or(bit, std::memory_order_acq_rel);
  }
  CUtensorMap tm_q, tm_k, tm_v;
  const TensorView q = q_view(p), k = k_view(p), v = v_view(p);
  if (cudaError_t err = make_tensor_map(q, T::kBlockM, &tm_q); err != cudaSuccess) return err;
  if (cudaError_t err = make_tensor_map(k, T::kBlockN, &tm_k); err != cudaSuccess) return err;
  if (cudaError_t err = make_tensor_map(v, T::kBlockN, &tm_v); err != cudaSuccess) return err;
  int sm_count = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess)
    return err;
  const int tiles_per_head = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  const int64_t tiles = int64_t(tiles_per_head) * p.heads_q * p.batch;
  if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const int grid = grid_blocks(p, int(tiles), tiles_per_head, sm_count);
  kernel<<<grid, T::kNThreads, T::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v);
  return cudaGetLastError();
}

}  // namespace flashserve::kernels::cuda::sm90
