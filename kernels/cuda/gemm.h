// Warp-level tile products of the forward kernel, on mma.sync m16n8k16 with fp32 accumulators:
//   S[kMTiles*16][kBlockN]  = Q[rows][kHeadDim] . K[kBlockN][kHeadDim]^T   (A: Q, B: K rows)
//   O[kMTiles*16][kHeadDim] += P[rows][kBlockN] . V[kBlockN][kHeadDim]     (A: P regs, B: V^T)
// Fragment layouts (PTX ISA, m16n8k16): lane l has g = l / 4, q = l % 4;
//   A regs a0..a3 = (row g, k 2q..2q+1), (row g+8, same k), (row g, k 8+2q..), (row g+8, k 8+2q..)
//   B regs b0, b1 = (k 2q..2q+1, col g), (k 8+2q.., col g)
//   C regs c0..c3 = (row g, col 2q), (row g, col 2q+1), (row g+8, col 2q), (row g+8, col 2q+1)
// so the C fragments of two adjacent n8 tiles of S, packed to 16 bits, are exactly the A
// fragment of P for one k16 step: P never leaves registers.
#pragma once

#include <cstdint>

#include "ptx.h"
#include "swizzle.h"

namespace flashserve::kernels::cuda {

/// Per-lane shared-memory byte offsets for the ldmatrix.x4 loads, computed once per thread.
/// Every row a lane addresses is (16-aligned tile row) + a lane-fixed part, so its swizzle phase
/// is fixed; chunk 2*ks + c of a row then sits at base[ks % kPeriod] + (ks / kPeriod) * group
/// bytes. The inner loops therefore address shared memory as (one of kPeriod base registers) +
/// (compile-time immediate): no per-load integer arithmetic and few live address registers.
/// kOneBase: with the 8-chunk swizzle the kPeriod bases of an operand differ only in address
/// bits 5-6 (base[i] = base[0] ^ 32 * i; tiles are 128-byte aligned), so one register per operand
/// can be kept and each tile's addresses formed as (tile + base) ^ 32 * (ks % 4): 3 live address
/// registers instead of 12. Used only by the lazy-rescale kernels at head_dim >= 128, where ptxas
/// (sm_90, bf16 d=128 m128n64w4s2l) then spills 0 B instead of 48 B; the exact-rescale kernels
/// spill more with it (88 -> 124 B), so they keep the kPeriod bases.
template <typename Traits>
struct LdmatrixOffsets {
  using Swz = Swizzle<Traits::kChunksPerRow>;
  static constexpr int kRowBytes = Traits::kHeadDim * 2;
  static constexpr int kPeriod = (Swz::kMask + 1) / 2;       // k16 steps per swizzle group
  static constexpr int kGroupBytes = (Swz::kMask + 1) * 16;  // bytes per swizzle group
  static constexpr bool kOneBase =
      Traits::kLazyRescale && Swz::kMask == 7 && Traits::kChunksPerRow >= 16;
  static constexpr int kBases = kOneBase ? 1 : kPeriod;
  uint32_t q[kBases];  // Q: rows warp_row0 + lane % 16, chunks 2i + lane / 16
  uint32_t k[kBases];  // K: rows (m / 2) * 8 + lane % 8, chunks 2i + m % 2   (m = lane / 8)
  uint32_t v[kBases];  // V: rows (m % 2) * 8 + lane % 8, chunks 2i + m / 2

  __device__ __forceinline__ LdmatrixOffsets(int lane, int warp_row0) {
    const int m = lane / 8;  // which 8x8 matrix this lane addresses
    // Q matrices: (r0-7,k0-7) (r8-15,k0-7) (r0-7,k8-15) (r8-15,k8-15) = A regs a0..a3.
    const int q_row = warp_row0 + lane % 16, q_chunk = lane / 16;
    // K matrices: (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15) = b0,b1 of two n8 tiles.
    const int k_row = (m / 2) * 8 + lane % 8, k_chunk = m % 2;
    // V matrices (transposed): (kv0-7,d0-7) (kv8-15,d0-7) (kv0-7,d8-15) (kv8-15,d8-15).
    const int v_row = (m % 2) * 8 + lane % 8, v_chunk = m / 2;
#pragma unroll
    for (int i = 0; i < kBases; ++i) {
      q[i] = Swz::offset(q_row, 2 * i + q_chunk) * 2;
      k[i] = Swz::offset(k_row, 2 * i + k_chunk) * 2;
      v[i] = Swz::offset(v_row, 2 * i + v_chunk) * 2;
    }
  }

  /// Byte offset of k16 step / d16 pair `step` relative to base[step % kPeriod].
  __device__ __forceinline__ static constexpr uint32_t step_bytes(int step) {
    return (step / kPeriod) * kGroupBytes;
  }

  /// Shared-memory address of k16 step / d16 pair `step` of the tile at `tile` (128-byte
  /// aligned), for one operand's bases; add whole-row offsets (multiples of 16 rows) to it.
  __device__ __forceinline__ static uint32_t addr(uint32_t tile, const uint32_t (&base)[kBases],
                                                  int step) {
    if constexpr (kOneBase) {
      return ((tile + base[0]) ^ uint32_t(32 * (step % kPeriod))) + step_bytes(step);
    } else {
      return tile + base[step % kPeriod] + step_bytes(step);
    }
  }
};

/// Loads the A fragments of one k16 step of the warp's Q rows.
template <typename Traits>
__device__ __forceinline__ void load_q_frag(uint32_t (&a)[Traits::kMTiles][4], uint32_t sQ,
                                            const LdmatrixOffsets<Traits>& off, int ks) {
  using Off = LdmatrixOffsets<Traits>;
#pragma unroll
  for (int mi = 0; mi < Traits::kMTiles; ++mi)
    ptx::ldmatrix_x4(a[mi], Off::addr(sQ, off.q, ks) + mi * 16 * Off::kRowBytes);
}

template <typename Traits>
__device__ __forceinline__ const uint32_t (&select_a(const uint32_t (&a)[Traits::kMTiles][4],
                                                     const uint32_t (*q_regs)[Traits::kMTiles][4],
                                                     int ks, int mi))[4] {
  if constexpr (Traits::kQInRegs) {
    return q_regs[ks][mi];
  } else {
    return a[mi];
  }
}

/// S = Q K^T for the warp's rows over one K tile. Q comes from registers (q_regs, all k16 steps)
/// when Traits::kQInRegs, else from shared memory (one ldmatrix.x4 per m-tile and k16 step).
/// The loops are fully unrolled, so ptxas hoists the ldmatrix of later steps over the MMAs of
/// earlier ones as far as registers allow (explicit two-deep fragment buffers spilled at
/// kMTiles = 2, head_dim 128).
template <typename Traits>
__device__ __forceinline__ void gemm_qk(float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                                        const uint32_t (*q_regs)[Traits::kMTiles][4], uint32_t sQ,
                                        uint32_t sK, const LdmatrixOffsets<Traits>& off) {
  using Off = LdmatrixOffsets<Traits>;
  constexpr int kSteps = Traits::kHeadDim / 16;
  constexpr int kNPairs = Traits::kBlockN / 16;
#pragma unroll
  for (int mi = 0; mi < Traits::kMTiles; ++mi)
#pragma unroll
    for (int nt = 0; nt < Traits::kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) s[mi][nt][i] = 0.f;

#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t a[Traits::kMTiles][4];
    if constexpr (!Traits::kQInRegs) load_q_frag<Traits>(a, sQ, off, ks);
#pragma unroll
    for (int np = 0; np < kNPairs; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, Off::addr(sK, off.k, ks) + np * 16 * Off::kRowBytes);
#pragma unroll
      for (int mi = 0; mi < Traits::kMTiles; ++mi) {
        const uint32_t(&af)[4] = select_a<Traits>(a, q_regs, ks, mi);
        ptx::mma_m16n8k16<typename Traits::Element>(s[mi][2 * np], af, b[0], b[1]);
        ptx::mma_m16n8k16<typename Traits::Element>(s[mi][2 * np + 1], af, b[2], b[3]);
      }
    }
  }
}

/// O += P V for the warp's rows over one V tile; P is s (already exponentiated), packed to
/// Element per k16 step; V fragments come from ldmatrix.trans (scheduled by ptxas as in gemm_qk).
template <typename Traits>
__device__ __forceinline__ void gemm_pv(float (&o)[Traits::kMTiles][Traits::kDTiles][4],
                                        const float (&s)[Traits::kMTiles][Traits::kNTiles][4],
                                        uint32_t sV, const LdmatrixOffsets<Traits>& off) {
  using Off = LdmatrixOffsets<Traits>;
  using Element = typename Traits::Element;
  constexpr int kSteps = Traits::kBlockN / 16;
  constexpr int kDPairs = Traits::kHeadDim / 16;
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    uint32_t a[Traits::kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < Traits::kMTiles; ++mi) {
      a[mi][0] = ptx::pack2<Element>(s[mi][2 * ks][0], s[mi][2 * ks][1]);
      a[mi][1] = ptx::pack2<Element>(s[mi][2 * ks][2], s[mi][2 * ks][3]);
      a[mi][2] = ptx::pack2<Element>(s[mi][2 * ks + 1][0], s[mi][2 * ks + 1][1]);
      a[mi][3] = ptx::pack2<Element>(s[mi][2 * ks + 1][2], s[mi][2 * ks + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < kDPairs; ++dp) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, Off::addr(sV, off.v, dp) + ks * 16 * Off::kRowBytes);
#pragma unroll
      for (int mi = 0; mi < Traits::kMTiles; ++mi) {
        ptx::mma_m16n8k16<Element>(o[mi][2 * dp], a[mi], b[0], b[1]);
        ptx::mma_m16n8k16<Element>(o[mi][2 * dp + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

}  // namespace flashserve::kernels::cuda
