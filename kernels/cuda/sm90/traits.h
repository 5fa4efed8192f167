// Compile-time shape of one sm90 forward kernel: tile sizes, warpgroup roles, register split
// and the shared-memory map (one or two Q tiles, a ring of K and V stages, the mbarriers).
#pragma once

#include <cstddef>
#include <cstdint>

#include "registry.h"  // the declaration (kPacked_'s default)

namespace flashserve::kernels::cuda::sm90 {

template <typename Element_, int kHeadDim_, int kBlockN_, int kStages_, int kConsumers_,
          bool kPacked_>
struct Sm90Traits {
  using Element = Element_;
  static_assert(sizeof(Element) == 2, "fp16/bf16 only");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static_assert(kHeadDim % 64 == 0, "the 128-byte swizzle holds 64 elements per row block");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma n / k granularity");

  // Warpgroup 0 produces (TMA), warpgroups 1..kConsumers each own 64 query rows: two (block_m
  // 128) or, at d=64, three (block_m 192, FlashAttention-3's d64 tile: each K/V tile loaded to
  // shared memory serves 1.5x the query rows).
  static constexpr int kConsumers = kConsumers_;
  // Packed variable-length inputs are a compile-time variant: as a run-time branch, the d=64
  // kernels lost 3-9% on fixed lengths (H100 A/B, kernels-varlen-h100-2026-11-24-sm90.md).
  static constexpr bool kPacked = kPacked_;
  using Packed = Sm90Traits<Element_, kHeadDim_, kBlockN_, kStages_, kConsumers_, true>;
  static_assert(kConsumers == 2 || kConsumers == 3, "named barrier ids (kernel.h) are for 2-3");
  static constexpr int kRowsPerConsumer = 64;  // wgmma m64
  static constexpr int kBlockM = kConsumers * kRowsPerConsumer;
  static constexpr int kNThreads = 128 * (kConsumers + 1);
  // Causal 192-row tiles end at the sequence's last row (scheduler.h's causal_shift). 128-row
  // tiles keep starting at row 0: there a tile's diagonal lines up with the 128-key blocks, and
  // shifted it crosses two, one more masked block per tile, which cost more than the row padding
  // saved (H200 A/B, kernels-varlen-h200-2026-11-29.md: 128 rows 0.96-0.99x at S1000 / S2000,
  // 192 rows 1.03-1.11x, mixed lengths 1.01-1.02x).
  static constexpr bool kCausalEndAligned = kConsumers == 3;
  // setmaxnreg: the producer needs a few dozen (40: the tile hand-over and dynamic schedule
  // spilled at 24 and 32); the consumers hold S, P and O in registers (ptxas: no spills at 232).
  // Two consumers: 40 * 128 + 232 * 256 = 64512 <= 65536 registers per SM. Three (d=64, block_n
  // 128: S 64 + P 32 + O 32 registers per thread): 32 * 128 + 160 * 384 = 65536, FlashAttention-3's
  // split (ptxas sm_90a: no spills; at 56 / 152 the consumers spilled 80 B and serialized their
  // wgmma, C7512).
  static constexpr int kProducerRegs = kConsumers == 2 ? 40 : 32;
  static constexpr int kConsumerRegs = kConsumers == 2 ? 232 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= 65536, "registers");
  // Packed: the producer skips tiles past a sequence's end (kernel.h). H200 A/B
  // (kernels-varlen-h200-2026-11-29-skip.md), mixed lengths: 128-row kernels with block_n 176 /
  // 192 +2-4%, block_n 128 within the spread; the 192-row kernel (32 producer registers) lost
  // 1.2-1.6% on equal lengths and gained nothing on mixed.
  static constexpr bool kSkipsRowlessTiles = kPacked && kConsumers == 2;
  static_assert(kConsumers == 2 || kHeadDim * kBlockN <= 64 * 128, "3 consumers: d64 n128 fit");

  // Tiles are stored as kColBlocks column blocks of [rows][64 elements] (128-byte rows), the
  // layout one TMA box with SWIZZLE_128B writes and wgmma reads with a 128B-swizzle descriptor.
  static constexpr int kColBlocks = kHeadDim / 64;
  static constexpr uint32_t kRowBytes = 128;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kRingBytes = 2 * kStages * kKVBytes;  // K and V stages
  // Two Q buffers where they fit (the next tile's Q loads during the current tile; the current
  // tile's buffer then stages its O for the TMA store), else one (block_n 176 at d128).
  static constexpr int kNumBarriersMax = 4 + 4 * kStages;
  // Per Q buffer, the tile handed over with it: its index and its sequence's span (SeqSpan).
  static constexpr uint32_t kTileSlotBytes = 20;
  static constexpr size_t kTwoQBufferBytes =
      2 * kQBytes + kRingBytes + 8 * kNumBarriersMax + 2 * kTileSlotBytes + 1024;
  static constexpr int kQBuffers = kTwoQBufferBytes <= 227 * 1024 ? 2 : 1;
  static constexpr uint32_t kQOffset = 0;
  static constexpr uint32_t kKOffset = kQOffset + kQBuffers * kQBytes;
  static constexpr uint32_t kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr uint32_t kBarOffset = kVOffset + kStages * kKVBytes;
  // Q loaded/empty per Q buffer, full/empty x K/V per stage.
  static constexpr int kNumBarriers = 2 * kQBuffers + 4 * kStages;
  // + the tile slots; + 1024: the dynamic shared-memory base is aligned up to 1024 bytes
  // (swizzle atom) in-kernel.
  static constexpr size_t kSmemBytes =
      kBarOffset + 8 * kNumBarriers + kQBuffers * kTileSlotBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the sm_90 shared-memory limit per block");
};

}  // namespace flashserve::kernels::cuda::sm90
