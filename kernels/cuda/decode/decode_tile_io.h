// Global-memory side of the decode kernel: which work a block owns, the cp.async loads of its
// query rows and K/V tiles (dense or paged), and the stores of its result.
#pragma once

#include <cstdint>

#include "decode_traits.h"
#include "ptx.h"

namespace flashserve::kernels::cuda::decode {

/// The work of one block, from its indices and the sequence's lengths.
struct BlockWork {
  int b = 0, hkv = 0, rb = 0, split = 0;
  int sq = 0, sk = 0;
  int rows = 0;        // packed rows of this (sequence, KV head): group * sq
  int tile_begin = 0;  // key tiles [tile_begin, tile_end) of kBlockN keys
  int tile_end = 0;
  int mask_from = 0;   // tiles reaching key mask_from need the mask (length or causal)
  int64_t q_row0 = 0;  // global query row index of the sequence's row 0 (partials, varlen LSE)
  int64_t q_off = 0, o_off = 0;  // elements to the sequence's row 0 in q / o
  int64_t k_off = 0, v_off = 0;  // elements to key 0 (dense) or to the head in a page (paged)
};

template <typename T>
__device__ __forceinline__ BlockWork block_work(const DecodeLaunch& L) {
  const DecodeParams& p = L.p;
  BlockWork w;
  w.split = blockIdx.x;
  w.hkv = blockIdx.y / L.row_blocks;
  w.rb = blockIdx.y % L.row_blocks;
  w.b = blockIdx.z;
  if (p.cu_seqlens_q != nullptr) {
    const int begin = p.cu_seqlens_q[w.b];
    w.sq = p.cu_seqlens_q[w.b + 1] - begin;
    w.q_row0 = begin;
    w.q_off = begin * p.q_row_stride;
    w.o_off = begin * p.o_row_stride;
  } else {
    w.sq = p.seqlen_q;
    w.q_row0 = int64_t{w.b} * p.seqlen_q;
    w.q_off = w.b * p.q_batch_stride;
    w.o_off = w.b * p.o_batch_stride;
  }
  if (p.seqlens_k != nullptr) {
    w.sk = p.seqlens_k[w.b];
  } else if (p.cu_seqlens_k != nullptr) {
    w.sk = p.cu_seqlens_k[w.b + 1] - p.cu_seqlens_k[w.b];
  } else {
    w.sk = p.seqlen_k;
  }
  w.k_off = w.hkv * p.k_head_stride;
  w.v_off = w.hkv * p.v_head_stride;
  if (p.block_table == nullptr) {
    const int64_t start = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[w.b] : 0;
    w.k_off += p.cu_seqlens_k != nullptr ? start * p.k_row_stride : w.b * p.k_batch_stride;
    w.v_off += p.cu_seqlens_k != nullptr ? start * p.v_row_stride : w.b * p.v_batch_stride;
  }
  w.rows = L.group * w.sq;
  const int tiles = (w.sk + T::kBlockN - 1) / T::kBlockN;
  const int per_split = (tiles + L.num_splits - 1) / L.num_splits;
  w.tile_begin = min(tiles, w.split * per_split);
  w.tile_end = min(tiles, w.tile_begin + per_split);
  w.mask_from = w.sk - (p.causal ? w.sq - 1 : 0);
  return w;
}

/// Last key each of a lane's two rows (block rows r and r + 8) may see: sk - 1, or the causal
/// bound qi + sk - sq (negative: the row sees nothing).
template <typename T>
__device__ __forceinline__ void row_key_limits(const DecodeLaunch& L, const BlockWork& w, int r,
                                               int (&limit)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int packed = w.rb * T::kBlockM + r + 8 * i;
    limit[i] = w.sk - 1;
    if (L.p.causal && packed < w.rows) limit[i] = min(limit[i], packed / L.group + w.sk - w.sq);
  }
}

/// Packed rows rb * kBlockM .. of the block into s_q (zeros past the sequence's rows).
template <typename T>
__device__ __forceinline__ void load_q_rows(const DecodeLaunch& L, const BlockWork& w,
                                            typename T::Element* s_q) {
  using Element = typename T::Element;
  const Element* q = static_cast<const Element*>(L.p.q);
  for (int i = threadIdx.x; i < T::kBlockM * T::kChunks; i += T::kThreads) {
    const int r = i / T::kChunks, ch = i % T::kChunks;
    const int packed = w.rb * T::kBlockM + r;
    const bool valid = packed < w.rows;
    const int qi = packed / L.group, h = w.hkv * L.group + packed % L.group;
    const Element* src = q + w.q_off + qi * L.p.q_row_stride + h * L.p.q_head_stride + ch * 8;
    ptx::cp_async_16_zfill(ptx::smem_addr(s_q + r * T::kRowElems + ch * 8), valid ? src : q,
                           valid);
  }
}

/// Keys key0 .. key0 + kBlockN - 1 of K into the tile at k_tile and of V into k_tile + tile
/// bytes; keys past sk become zeros (P is 0 there, and 0 * garbage could be NaN).
/// cp.async of 16 bytes (zeros when !valid) with an L2 prefetch hint of kPrefetch bytes: K/V
/// rows of one head are 128-512 contiguous bytes, so a wider L2 fill than the 32-byte sector
/// keeps more DRAM bursts whole.
template <int kPrefetch>
__device__ __forceinline__ void cp_async_kv(uint32_t smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  if constexpr (kPrefetch == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem),
                 "l"(gmem), "r"(src_bytes));
  } else if constexpr (kPrefetch == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem),
                 "l"(gmem), "r"(src_bytes));
  } else {
    ptx::cp_async_16_zfill(smem, gmem, valid);
  }
}

/// Where this thread's rows of one K/V tile live: row it of the thread is key key0 + row(it),
/// at page[it] * page stride + in_page[it] * row stride (dense: page 0, in_page = key). Looked
/// up one tile ahead of the loads that use it, so the block-table reads' latency hides behind a
/// tile of compute instead of delaying the next cp.async.
template <typename T>
struct TileRows {
  static constexpr int kIters = T::kBlockN * T::kChunks / T::kThreads;
  int key0 = 0;
  int page[kIters];
  int in_page[kIters];
};

template <typename T>
__device__ __forceinline__ int tile_row(int it) {
  return (threadIdx.x + it * T::kThreads) / T::kChunks;
}

template <typename T>
__device__ __forceinline__ void lookup_rows(const DecodeLaunch& L, const BlockWork& w, int key0,
                                            TileRows<T>& rows) {
  const DecodeParams& p = L.p;
  rows.key0 = key0;
  if (L.tile_in_page) {  // one block-table read for the whole tile
    const int kk = key0 < w.sk ? key0 : 0;
    const int page = __ldg(p.block_table + w.b * p.block_table_stride + (kk >> L.page_shift));
#pragma unroll
    for (int it = 0; it < TileRows<T>::kIters; ++it) {
      rows.page[it] = page;
      rows.in_page[it] = (kk & (p.page_size - 1)) + tile_row<T>(it);
    }
    return;
  }
#pragma unroll
  for (int it = 0; it < TileRows<T>::kIters; ++it) {
    const int key = key0 + tile_row<T>(it);
    if (p.block_table == nullptr) {
      rows.page[it] = 0;
      rows.in_page[it] = key;
    } else {
      const int kk = key < w.sk ? key : 0;  // rows past the end read nothing; any page will do
      const int slot = L.page_shift >= 0 ? kk >> L.page_shift : kk / p.page_size;
      rows.in_page[it] = L.page_shift >= 0 ? kk & (p.page_size - 1) : kk % p.page_size;
      rows.page[it] = __ldg(p.block_table + w.b * p.block_table_stride + slot);
    }
  }
}

/// Keys rows.key0 .. + kBlockN - 1 of K into the tile at k_tile and of V into k_tile + tile
/// bytes; keys past sk become zeros (P is 0 there, and 0 * garbage could be NaN).
template <typename T, int kPrefetch>
__device__ __forceinline__ void load_kv_tile(const DecodeLaunch& L, const BlockWork& w,
                                             const TileRows<T>& rows, uint32_t k_tile) {
  using Element = typename T::Element;
  const DecodeParams& p = L.p;
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int64_t k_page = p.block_table != nullptr ? p.k_batch_stride : 0;
  const int64_t v_page = p.block_table != nullptr ? p.v_batch_stride : 0;
#pragma unroll
  for (int it = 0; it < TileRows<T>::kIters; ++it) {
    const int i = threadIdx.x + it * T::kThreads;
    const int r = i / T::kChunks, ch = i % T::kChunks;
    const bool valid = rows.key0 + r < w.sk;
    const int64_t k_row = rows.page[it] * k_page + rows.in_page[it] * p.k_row_stride;
    const int64_t v_row = rows.page[it] * v_page + rows.in_page[it] * p.v_row_stride;
    const uint32_t dst = k_tile + (r * T::kRowElems + ch * 8) * 2;
    cp_async_kv<kPrefetch>(dst, valid ? k + w.k_off + k_row + ch * 8 : k, valid);
    cp_async_kv<kPrefetch>(dst + T::kTileElems * 2, valid ? v + w.v_off + v_row + ch * 8 : v,
                           valid);
  }
}

/// load_kv_tile with the launch's L2 prefetch hint (uniform branch).
template <typename T>
__device__ __forceinline__ void load_kv(const DecodeLaunch& L, const BlockWork& w,
                                        const TileRows<T>& rows, uint32_t k_tile) {
  if (L.l2_prefetch == 256) {
    load_kv_tile<T, 256>(L, w, rows, k_tile);
  } else if (L.l2_prefetch == 128) {
    load_kv_tile<T, 128>(L, w, rows, k_tile);
  } else {
    load_kv_tile<T, 0>(L, w, rows, k_tile);
  }
}

/// Index of (sequence b, row qi, head h) in the caller's LSE.
__device__ __forceinline__ int64_t lse_index(const DecodeLaunch& L, int b, int qi, int h,
                                             int64_t q_row0) {
  if (L.p.cu_seqlens_q != nullptr) return int64_t{h} * L.total_q + q_row0 + qi;
  return (int64_t{b} * L.p.heads_q + h) * L.p.seqlen_q + qi;
}

/// Four floats rounded to Element, stored as 8 bytes.
template <typename Element>
__device__ __forceinline__ void store4(Element* dst, float4 x) {
  uint2 packed;
  packed.x = ptx::pack2<Element>(x.x, x.y);
  packed.y = ptx::pack2<Element>(x.z, x.w);
  *reinterpret_cast<uint2*>(dst) = packed;
}

/// Sums the kWarpsN slices of s_o per row and writes O and LSE: the final result when one split
/// runs, else this split's fp32 partial for the combine kernel.
template <typename T>
__device__ __forceinline__ void store_rows(const DecodeLaunch& L, const BlockWork& w,
                                           const float* s_o, const float* s_lse) {
  using Element = typename T::Element;
  const DecodeParams& p = L.p;
  constexpr int kVecs = T::kHeadDim / 4;
  const bool final_out = L.num_splits == 1;
  for (int i = threadIdx.x; i < T::kBlockM * kVecs; i += T::kThreads) {
    const int r = i / kVecs, c = (i % kVecs) * 4;
    const int packed = w.rb * T::kBlockM + r;
    if (packed >= w.rows) continue;
    const int qi = packed / L.group, h = w.hkv * L.group + packed % L.group;
    float4 acc = *reinterpret_cast<const float4*>(s_o + r * T::kHeadDim + c);
#pragma unroll
    for (int j = 1; j < T::kWarpsN; ++j) {
      const float4 x = *reinterpret_cast<const float4*>(s_o + (j * T::kBlockM + r) * T::kHeadDim + c);
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    if (final_out) {
      Element* o = static_cast<Element*>(p.o);
      store4(o + w.o_off + qi * p.o_row_stride + h * p.o_head_stride + c, acc);
    } else {
      const int64_t row = (int64_t{w.split} * L.total_q + w.q_row0 + qi) * p.heads_q + h;
      *reinterpret_cast<float4*>(L.o_partial + row * T::kHeadDim + c) = acc;
    }
  }
  for (int r = threadIdx.x; r < T::kBlockM; r += T::kThreads) {
    const int packed = w.rb * T::kBlockM + r;
    if (packed >= w.rows) continue;
    const int qi = packed / L.group, h = w.hkv * L.group + packed % L.group;
    if (!final_out) {
      L.lse_partial[(int64_t{w.split} * L.total_q + w.q_row0 + qi) * p.heads_q + h] = s_lse[r];
    } else if (p.lse != nullptr) {
      p.lse[lse_index(L, w.b, qi, h, w.q_row0)] = s_lse[r];
    }
  }
}

}  // namespace flashserve::kernels::cuda::decode
