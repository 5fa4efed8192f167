// The sm80 flash-attention forward kernel (FlashAttention-2 algorithm): one thread block per
// (query tile, head, batch); K/V tiles are visited from the last one backwards with an online
// softmax, so the masked tiles (the key tail, the causal diagonal) come first and the rest run
// without any masking or bounds checks.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flashserve/kernels/attention_params.h"
#include "gemm.h"
#include "kernel_traits.h"
#include "load_store.h"
#include "mask.h"
#include "ptx.h"
#include "sequence.h"
#include "softmax.h"
#include "swizzle.h"

namespace flashserve::kernels::cuda {

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

/// Forward attention for one query tile of one (batch, head).
///   q: [batch, seqlen_q, heads_q, head_dim], k/v: [batch, seqlen_k, heads_kv, head_dim],
///   o: [batch, seqlen_q, heads_q, head_dim], lse: [batch, heads_q, seqlen_q] fp32 (optional);
///   kVarlen: packed variable-length sequences instead (p.cu_seqlens_q/k, sequence.h), grid z
///   over sequences and x over the longest one's tiles (blocks past a sequence's end exit);
/// element strides from p, head_dim contiguous; pointers and strides 16-byte aligned.
/// grid = (ceil(seqlen_q / kBlockM), heads_q, batch); block = kNThreads; dynamic smem
/// Traits::kSmemBytes. Query tiles sharing a K/V head are adjacent in launch order (L2 reuse);
/// for causal problems the heaviest tiles (last rows) launch first.
template <typename Traits, bool kVarlen>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_kernel(const __grid_constant__ AttentionParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr uint32_t kKVBytes = Traits::kSmemKVElems * sizeof(Element);
  using Swz = Swizzle<Traits::kChunksPerRow>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  Element* sK = sQ + Traits::kSmemQElems;
  Element* sV = sK + Traits::kStages * Traits::kSmemKVElems;

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int m_block = p.causal ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
  const int head = blockIdx.y;
  const SequenceView seq = sequence_view<kVarlen>(p, blockIdx.z, head);
  if (kVarlen && m_block * kBlockM >= seq.seqlen_q) return;  // a shorter sequence
  const int head_kv = head / (p.heads_q / p.heads_kv);

  const Element* q = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride +
                     int64_t(m_block) * kBlockM * p.q_row_stride;
  const Element* k = static_cast<const Element*>(p.k) + seq.k_offset + head_kv * p.k_head_stride;
  const Element* v = static_cast<const Element*>(p.v) + seq.v_offset + head_kv * p.v_head_stride;
  Element* o = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride +
               int64_t(m_block) * kBlockM * p.o_row_stride;
  float* lse_out = p.lse == nullptr ? nullptr : p.lse + seq.lse_offset + m_block * kBlockM;
  const int rows_valid_q = min(kBlockM, seq.seqlen_q - m_block * kBlockM);

  const Mask mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, p.causal};
  int n_block_max = ceil_div(seq.seqlen_k, kBlockN);
  if (p.causal) {
    // One past the last column the tile's last row may see.
    const int col_end = (m_block + 1) * kBlockM + seq.seqlen_k - seq.seqlen_q;
    n_block_max = min(n_block_max, col_end <= 0 ? 0 : ceil_div(col_end, kBlockN));
  }

  if (n_block_max <= 0) {  // no row of this tile sees any key: O = 0, LSE = -inf
    for (int idx = tid; idx < rows_valid_q * Traits::kChunksPerRow; idx += Traits::kNThreads) {
      const int row = idx / Traits::kChunksPerRow, chunk = idx % Traits::kChunksPerRow;
      *reinterpret_cast<uint4*>(o + row * p.o_row_stride + chunk * 8) = make_uint4(0, 0, 0, 0);
    }
    if (lse_out != nullptr)
      for (int row = tid; row < rows_valid_q; row += Traits::kNThreads) lse_out[row] = -INFINITY;
    return;
  }

  const uint32_t sQa = ptx::smem_addr(sQ);
  const uint32_t sKa = ptx::smem_addr(sK);
  const uint32_t sVa = ptx::smem_addr(sV);
  const int warp_row0 = warp * Traits::kRowsPerWarp;  // within the tile
  const LdmatrixOffsets<Traits> off(lane, warp_row0);

  // Prologue: Q and the last K tile (and, with two stages, the last V tile) in flight.
  int n_block = n_block_max - 1;
  const int rows_valid_kv = seq.seqlen_k - n_block * kBlockN;  // may be < kBlockN only here
  if (rows_valid_q == kBlockM) {
    load_tile<Traits, kBlockM, false>(sQ, q, p.q_row_stride, kBlockM, tid);
  } else {
    load_tile<Traits, kBlockM, true>(sQ, q, p.q_row_stride, rows_valid_q, tid);
  }
  auto load_kv_tile = [&](Element* smem, const Element* base, int64_t row_stride, int nb,
                          bool predicated) {
    const Element* src = base + int64_t(nb) * kBlockN * row_stride;
    if (predicated) {
      load_tile<Traits, kBlockN, true>(smem, src, row_stride, rows_valid_kv, tid);
    } else {
      load_tile<Traits, kBlockN, false>(smem, src, row_stride, kBlockN, tid);
    }
  };
  const bool tail_kv = rows_valid_kv < kBlockN;
  load_kv_tile(sK, k, p.k_row_stride, n_block, tail_kv);
  ptx::cp_async_commit();
  if constexpr (Traits::kStages == 2) {
    load_kv_tile(sV, v, p.v_row_stride, n_block, tail_kv);
    ptx::cp_async_commit();
  }

  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc_o[mi][dt][i] = 0.f;
  uint32_t q_regs[Traits::kQInRegs ? Traits::kHeadDim / 16 : 1][kMTiles][4];
  OnlineSoftmax<kMTiles, kNTiles, kDTiles, Traits::kLazyRescale> softmax;
  const float scale_log2 = p.softmax_scale_log2;
  int stage = 0;

  // One K/V tile: S = Q K^T, mask, online softmax, O += P V, with the copies of the next K/V
  // tiles issued as soon as their buffers are free.
  auto step = [&](auto first_tag, auto mask_tag) {
    constexpr bool kFirst = decltype(first_tag)::value;
    constexpr bool kMask = decltype(mask_tag)::value;
    const uint32_t sK_cur = sKa + (Traits::kStages == 2 ? stage * kKVBytes : 0);
    const uint32_t sV_cur = sVa + (Traits::kStages == 2 ? stage * kKVBytes : 0);
    if constexpr (Traits::kStages == 2) {
      ptx::cp_async_wait<1>();  // K[n_block] (and Q) landed; V[n_block] may be in flight
      __syncthreads();
      if (n_block > 0)
        load_kv_tile(sK + (stage ^ 1) * Traits::kSmemKVElems, k, p.k_row_stride, n_block - 1,
                     false);
      ptx::cp_async_commit();
    } else {
      ptx::cp_async_wait<0>();  // K[n_block] (and Q) landed; all warps are done with sV
      __syncthreads();
      load_kv_tile(sV, v, p.v_row_stride, n_block, kFirst && tail_kv);
      ptx::cp_async_commit();
    }
    if constexpr (kFirst && Traits::kQInRegs) {
#pragma unroll
      for (int ks = 0; ks < Traits::kHeadDim / 16; ++ks)
        load_q_frag<Traits>(q_regs[ks], sQa, off, ks);
    }

    float acc_s[kMTiles][kNTiles][4];
    gemm_qk<Traits>(acc_s, q_regs, sQa, sK_cur, off);
    if constexpr (kMask) mask.apply(acc_s, m_block * kBlockM + warp_row0, n_block * kBlockN, lane);
    softmax.template update<kFirst>(acc_s, acc_o, scale_log2);

    if constexpr (Traits::kStages == 2) {
      ptx::cp_async_wait<1>();  // V[n_block] landed; K[n_block - 1] may be in flight
      __syncthreads();
      if (n_block > 0)
        load_kv_tile(sV + (stage ^ 1) * Traits::kSmemKVElems, v, p.v_row_stride, n_block - 1,
                     false);
      ptx::cp_async_commit();
      stage ^= 1;
    } else {
      ptx::cp_async_wait<0>();  // V[n_block] landed; all warps are done with sK
      __syncthreads();
      if (n_block > 0) load_kv_tile(sK, k, p.k_row_stride, n_block - 1, false);
      ptx::cp_async_commit();
    }
    gemm_pv<Traits>(acc_o, acc_s, sV_cur, off);
    --n_block;
  };

  using True = std::true_type;
  using False = std::false_type;
  step(True{}, True{});  // the last tile: key tail and/or diagonal, never rescales
  for (; n_block >= 0 && mask.tile_needs_mask(m_block * kBlockM, n_block, kBlockN);)
    step(False{}, True{});
  for (; n_block >= 0;) step(False{}, False{});

  // Epilogue: normalize, LSE, stage O (as Element) in sQ's rows of this warp, 16-byte stores.
  float lse[2 * kMTiles];
  softmax.finalize(acc_o, p.softmax_scale, kMaxScaledLogit<Element>, lse);
  if (lse_out != nullptr && lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2 * kMTiles; ++r) {
      const int row = warp_row0 + (r / 2) * 16 + (r % 2) * 8 + lane / 4;
      if (row < rows_valid_q) lse_out[row] = lse[r];
    }
  }
  __syncthreads();  // every warp is done reading sQ
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row0 + mi * 16 + h * 8 + lane / 4;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const uint32_t packed =
            ptx::pack2<Element>(acc_o[mi][dt][2 * h], acc_o[mi][dt][2 * h + 1]);
        *reinterpret_cast<uint32_t*>(sQ + Swz::offset(row, dt) + (lane % 4) * 2) = packed;
      }
    }
  __syncthreads();
  store_tile<Traits>(sQ, o, p.o_row_stride, rows_valid_q, tid);
}

}  // namespace flashserve::kernels::cuda
