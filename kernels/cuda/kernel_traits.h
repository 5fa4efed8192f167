// Compile-time description of one configuration of the sm80 forward kernel: tile sizes,
// warp layout, shared-memory layout and pipeline flags, all derived from template parameters.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

namespace flashserve::kernels::cuda {

/// Element_: __half or __nv_bfloat16. kBlockM query rows per block are split among kNWarps
/// warps, each owning kMTiles consecutive m16 tiles (kBlockM / kNWarps rows); every warp
/// computes all kBlockN columns of S and all kHeadDim columns of O for its rows.
/// kStages: shared-memory buffers for each of K and V (1: FA2's order, 2: the load of the next
/// K/V tile starts one phase earlier). kQInRegs: Q's mma fragments stay in registers for the
/// whole loop instead of being re-read from shared memory for every K tile. kLazyRescale: the
/// online softmax moves a row's running max (rescaling O and the row sum) only when it grows by
/// more than KernelConfig::kLazyRescaleThresholdLog2 (softmax.h).
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kStages_,
          bool kQInRegs_, bool kLazyRescale_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr bool kLazyRescale = kLazyRescale_;

  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
  static constexpr int kNTiles = kBlockN / 8;        // n8 tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;       // n8 tiles of O per warp
  static constexpr int kChunksPerRow = kHeadDim / 8; // 16-byte chunks per smem row

  // Shared memory (elements): Q [kBlockM][kHeadDim], then kStages K tiles, then kStages V
  // tiles, each [kBlockN][kHeadDim]; all swizzled (swizzle.h). Q's region stages O at the end.
  static constexpr int kSmemQElems = kBlockM * kHeadDim;
  static constexpr int kSmemKVElems = kBlockN * kHeadDim;
  static constexpr size_t kSmemBytes =
      size_t(kSmemQElems + 2 * kStages * kSmemKVElems) * sizeof(Element);

  // cp.async tile copies: each thread moves one 16-byte chunk column; rows advance by kLoadRowStep.
  static constexpr int kLoadRowStep = kNThreads / kChunksPerRow > 0 ? kNThreads / kChunksPerRow : 1;

  static_assert(sizeof(Element) == 2, "16-bit element types only");
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head_dim must be a multiple of 16, <= 256");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(kMTiles >= 1 && kMTiles <= 2, "1 or 2 m16 tiles per warp");
  static_assert(kBlockN % 16 == 0, "block_n must be a multiple of 16");
  static_assert(kStages == 1 || kStages == 2, "1 or 2 K/V stages");
  // Fast copy path (load_store.h): the threads cover whole rows and the tiles whole passes, so each
  // thread keeps one chunk column. Otherwise (head_dim 96) a generic index walk is used.
  static constexpr bool kRowAlignedCopy = kNThreads % kChunksPerRow == 0 &&
                                          kBlockM % (kNThreads / kChunksPerRow) == 0 &&
                                          kBlockN % (kNThreads / kChunksPerRow) == 0;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory exceeds the sm_90 limit");
};

}  // namespace flashserve::kernels::cuda
