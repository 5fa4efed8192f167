// The split-KV decode kernel: block (split, KV head x row block, sequence) walks its share of
// the sequence's key tiles through a K/V pipeline (cp.async; on sm_90 TMA boxes, decode_tma.h),
// computes S = Q K^T and O += P V on mma.sync with an online softmax per warp, merges its warps,
// and writes either the final O/LSE (one split) or an fp32 partial O and its LSE, merged by the
// group's last block (decode_merge.h) or by decode_combine.cu.
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "decode_merge.h"
#include "decode_tile_io.h"
#include "decode_tma.h"
#include "decode_traits.h"
#include "ptx.h"

namespace flashserve::kernels::cuda::decode {

/// The softmax state and O accumulator of one warp's 16 rows (two rows per lane: g, g + 8).
template <typename T>
struct WarpState {
  float o[T::kDTiles][4];
  float m[2];  // running max of the scaled scores (log2 domain); -inf: no key seen yet
  float l[2];  // this lane's part of the running row sum (reduced over the quad at the end)
};

/// The swizzled chunk of chunk c in row r of a TMA slice: 128-byte rows, c ^ (r % 8); 64-byte
/// rows (d32 / d96), c ^ ((r / 2) % 4). Both depend on r % 8 only.
template <typename T>
__device__ __forceinline__ int swizzled_chunk(int c, int r) {
  return T::kSliceBytes == 128 ? c ^ (r % 8) : c ^ ((r / 2) % 4);
}

/// Shared-memory address of the ldmatrix of 16-byte chunk step `step` (2 chunks per step) and
/// row offset `row16` x 16 for a lane whose step-0 address is lane_addr. Padded rows: plain
/// offsets. Swizzled (TMA, rows of kSliceBytes in kTmaSlices slices of kBlockN rows): a lane's
/// row is fixed mod 8, so its swizzle is too (swizzled_chunk), the step's XOR touches address
/// bits 5-6 (bit 5 on 64-byte rows) only and the slice / row offsets stay immediates.
template <typename T, bool kSwizzled>
__device__ __forceinline__ uint32_t kv_chunk_addr(uint32_t lane_addr, int step, int row16) {
  if constexpr (kSwizzled) {
    constexpr int kSteps = T::kSliceCols / 16;  // steps per slice
    return (lane_addr ^ uint32_t(32 * (step % kSteps))) +
           (step / kSteps) * T::kBlockN * T::kSliceBytes + row16 * 16 * T::kSliceBytes;
  } else {
    return lane_addr + step * 32 + row16 * 16 * T::kRowElems * 2;
  }
}

/// S = Q K^T for the warp's 16 rows and kWarpN keys of the tile in shared memory.
template <typename T, bool kSwizzled>
__device__ __forceinline__ void warp_qk(float (&s)[T::kNTiles][4], uint32_t q_addr,
                                        uint32_t k_addr) {
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = 0.f;
#pragma unroll
  for (int ks = 0; ks < T::kHeadDim / 16; ++ks) {
    uint32_t a[4];
    ptx::ldmatrix_x4(a, q_addr + ks * 32);
#pragma unroll
    for (int np = 0; np < T::kNTiles / 2; ++np) {
      uint32_t b[4];
      ptx::ldmatrix_x4(b, kv_chunk_addr<T, kSwizzled>(k_addr, ks, np));
      ptx::mma_m16n8k16<typename T::Element>(s[2 * np], a, b[0], b[1]);
      ptx::mma_m16n8k16<typename T::Element>(s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

/// O += P V with P = s (exponentiated) packed to 16 bits per k16 step of keys.
template <typename T, bool kSwizzled>
__device__ __forceinline__ void warp_pv(WarpState<T>& st, const float (&s)[T::kNTiles][4],
                                        uint32_t v_addr) {
  using Element = typename T::Element;
#pragma unroll
  for (int ks = 0; ks < T::kWarpN / 16; ++ks) {
    uint32_t a[4];
    a[0] = ptx::pack2<Element>(s[2 * ks][0], s[2 * ks][1]);
    a[1] = ptx::pack2<Element>(s[2 * ks][2], s[2 * ks][3]);
    a[2] = ptx::pack2<Element>(s[2 * ks + 1][0], s[2 * ks + 1][1]);
    a[3] = ptx::pack2<Element>(s[2 * ks + 1][2], s[2 * ks + 1][3]);
#pragma unroll
    for (int dp = 0; dp < T::kHeadDim / 16; ++dp) {
      uint32_t b[4];
      ptx::ldmatrix_x4_trans(b, kv_chunk_addr<T, kSwizzled>(v_addr, dp, ks));
      ptx::mma_m16n8k16<Element>(st.o[2 * dp], a, b[0], b[1]);
      ptx::mma_m16n8k16<Element>(st.o[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

/// Scales s to the log2 domain, masks keys past limit[row] (when mask), moves the running max,
/// rescales O and the row sums, and turns s into P = 2^(s - max).
template <typename T>
__device__ __forceinline__ void online_softmax(WarpState<T>& st, float (&s)[T::kNTiles][4],
                                               float scale_log2, bool mask, int key0,
                                               const int (&limit)[2], int lane) {
  float mx[2] = {st.m[0], st.m[1]};
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[nt][e] * scale_log2;
      if (mask && key0 + nt * 8 + 2 * (lane % 4) + (e & 1) > limit[e / 2]) x = -INFINITY;
      s[nt][e] = x;
      mx[e / 2] = fmaxf(mx[e / 2], x);
    }
  float base[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    // A row that has seen no key yet keeps max -inf; subtract 0 so P = 2^-inf = 0, not NaN.
    base[i] = mx[i] == -INFINITY ? 0.f : mx[i];
    const float alpha = ptx::exp2_approx(st.m[i] - base[i]);  // 2^-inf = 0 on the first key
    st.m[i] = mx[i];
    st.l[i] *= alpha;
#pragma unroll
    for (int dt = 0; dt < T::kDTiles; ++dt) {
      st.o[dt][2 * i] *= alpha;
      st.o[dt][2 * i + 1] *= alpha;
    }
  }
#pragma unroll
  for (int nt = 0; nt < T::kNTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = ptx::exp2_approx(s[nt][e] - base[e / 2]);
      st.l[e / 2] += s[nt][e];
    }
}

/// Merges the kWarpsN warps of each row block through shared memory and writes the block's
/// normalized O (final dtype, or fp32 partial) and its LSE.
template <typename T>
__device__ void write_block_result(WarpState<T>& st, const DecodeLaunch& L, const BlockWork& w,
                                   char* smem) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % T::kWarpsM, wn = warp / T::kWarpsM;
  float* s_o = reinterpret_cast<float*>(smem);                    // [kWarpsN][kBlockM][d]
  float* s_m = s_o + T::kWarpsN * T::kBlockM * T::kHeadDim;       // [kWarpsN][kBlockM]
  float* s_l = s_m + T::kWarpsN * T::kBlockM;                     // [kWarpsN][kBlockM]
  float* s_lse = s_l + T::kWarpsN * T::kBlockM;                   // [kBlockM]
  const int row[2] = {wm * 16 + lane / 4, wm * 16 + lane / 4 + 8};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 1);
    st.l[i] += __shfl_xor_sync(0xffffffffu, st.l[i], 2);
    if (lane % 4 == 0) {
      s_m[wn * T::kBlockM + row[i]] = st.m[i];
      s_l[wn * T::kBlockM + row[i]] = st.l[i];
    }
  }
  __syncthreads();
  float factor[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float m_all = -INFINITY;
#pragma unroll
    for (int j = 0; j < T::kWarpsN; ++j) m_all = fmaxf(m_all, s_m[j * T::kBlockM + row[i]]);
    float l_all = 0.f;
    bool poisoned = false;  // a NaN score: the warp's sum is NaN (fmaxf kept the max finite)
#pragma unroll
    for (int j = 0; j < T::kWarpsN; ++j) {
      const float l = s_l[j * T::kBlockM + row[i]];
      poisoned |= l != l;
      if (m_all != -INFINITY) l_all += l * ptx::exp2_approx(s_m[j * T::kBlockM + row[i]] - m_all);
    }
    // NaN O and LSE for a poisoned row, as on the CPU: read as "saw no key" (LSE -inf), a split's
    // partial would be dropped by the merge and the answer would depend on the split count.
    const bool seen = l_all > 0.f;
    factor[i] = poisoned ? CUDART_NAN_F : seen ? ptx::exp2_approx(st.m[i] - m_all) / l_all : 0.f;
    if (wn == 0 && lane % 4 == 0)
      s_lse[row[i]] = poisoned ? CUDART_NAN_F
                      : seen   ? (m_all + __log2f(l_all)) * 0.6931471805599453f
                               : -INFINITY;
  }
  float* my_o = s_o + wn * T::kBlockM * T::kHeadDim;
#pragma unroll
  for (int dt = 0; dt < T::kDTiles; ++dt) {
    const int col = dt * 8 + 2 * (lane % 4);
    *reinterpret_cast<float2*>(my_o + row[0] * T::kHeadDim + col) =
        make_float2(st.o[dt][0] * factor[0], st.o[dt][1] * factor[0]);
    *reinterpret_cast<float2*>(my_o + row[1] * T::kHeadDim + col) =
        make_float2(st.o[dt][2] * factor[1], st.o[dt][3] * factor[1]);
  }
  __syncthreads();
  store_rows<T>(L, w, s_o, s_lse);
}

/// Pipeline of the split kernel on 16-byte cp.async (every architecture).
template <typename T>
struct AsyncPipe {
  static constexpr bool kSwizzled = false;
  static constexpr uint32_t kTileBytes = T::kTileElems * 2;
  static __device__ __forceinline__ uint32_t kv_base(uint32_t q_end) { return q_end; }
  const DecodeLaunch& L;
  const BlockWork& w;
  TileRows<T> rows;
  __device__ __forceinline__ AsyncPipe(const DecodeLaunch& l, const BlockWork& wk) : L(l), w(wk) {}
  __device__ __forceinline__ void lookup(int key0) { lookup_rows<T>(L, w, key0, rows); }
  __device__ __forceinline__ void issue(int /*stage*/, uint32_t k_tile) {
    load_kv<T>(L, w, rows, k_tile);
  }
  __device__ __forceinline__ void commit() { ptx::cp_async_commit(); }
  /// Waits for the tile of step t: at most kStages - 2 younger groups still in flight, or
  /// kStages - 1 when the next tile was issued before the wait (deep).
  __device__ __forceinline__ void wait(int /*t*/, bool deep, uint32_t /*k_tile*/) {
    if (deep) {
      ptx::cp_async_wait<T::kStages - 1>();
    } else {
      ptx::cp_async_wait<T::kStages - 2>();
    }
  }
};

/// The split kernel's body over a K/V pipeline (AsyncPipe, or TmaPipe on sm_90).
template <typename T, typename Pipe>
__device__ __forceinline__ void split_body(const DecodeLaunch& L, const BlockWork& w, Pipe& pipe,
                                           char* smem) {
  using Element = typename T::Element;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp % T::kWarpsM, wn = warp / T::kWarpsM;
  Element* s_q = reinterpret_cast<Element*>(smem);
  // Stage i: K at 2i tiles, V at 2i + 1 (padded rows, or the pipe's swizzled layout).
  const uint32_t q_base = ptx::smem_addr(s_q);
  const uint32_t kv_base = Pipe::kv_base(q_base + T::kQElems * 2);
  constexpr uint32_t kTileBytes = Pipe::kTileBytes;

  // Prologue: Q with the first tile in group 0, then tiles 1 .. kStages - 2 one group each.
  load_q_rows<T>(L, w, s_q);
  const int n_tiles = w.tile_end - w.tile_begin;
#pragma unroll
  for (int st = 0; st < T::kStages - 1; ++st) {
    if (st < n_tiles) {
      pipe.lookup((w.tile_begin + st) * T::kBlockN);
      pipe.issue(st, kv_base + 2 * st * kTileBytes);
    }
    pipe.commit();
  }
  // The pipe always holds the lookup of the next tile to load (index t + kStages - 1 at step t).
  if (T::kStages - 1 < n_tiles) pipe.lookup((w.tile_begin + T::kStages - 1) * T::kBlockN);

  WarpState<T> st;
#pragma unroll
  for (int dt = 0; dt < T::kDTiles; ++dt)
#pragma unroll
    for (int i = 0; i < 4; ++i) st.o[dt][i] = 0.f;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;

  // Per-lane ldmatrix addresses (bytes): Q rows wm*16 + lane%16, chunk lane/16; K rows
  // (lane/16)*8 + lane%8, chunk (lane/8)%2; V rows ((lane/8)%2)*8 + lane%8, chunk lane/16.
  const uint32_t q_addr = q_base + ((wm * 16 + lane % 16) * T::kRowElems + (lane / 16) * 8) * 2;
  // Swizzled tiles: rows of kSliceBytes, chunk c of row r at swizzled_chunk (kv_chunk_addr);
  // k_row % 8 == v_row % 8 == lane % 8.
  const int k_row = wn * T::kWarpN + (lane / 16) * 8 + lane % 8, k_chunk = (lane / 8) % 2;
  const int v_row = wn * T::kWarpN + ((lane / 8) % 2) * 8 + lane % 8, v_chunk = lane / 16;
  const uint32_t k_lane = Pipe::kSwizzled
                              ? k_row * T::kSliceBytes + swizzled_chunk<T>(k_chunk, lane % 8) * 16
                              : (k_row * T::kRowElems + k_chunk * 8) * 2;
  const uint32_t v_lane = Pipe::kSwizzled
                              ? v_row * T::kSliceBytes + swizzled_chunk<T>(v_chunk, lane % 8) * 16
                              : (v_row * T::kRowElems + v_chunk * 8) * 2;
  int limit[2];
  row_key_limits<T>(L, w, wm * 16 + lane / 4, limit);

  // Tile t + kStages - 1 goes into the stage of tile t - 1. Default order: wait for tile t, one
  // barrier, then issue (kStages - 1 tiles in flight during the wait). Deep order (L.deep_issue):
  // a barrier after each tile's compute frees its stage at once, so the issue comes before the
  // wait and kStages tiles are in flight during it, at the cost of a second barrier per tile.
  const bool deep = L.deep_issue;
  auto issue_next = [&](int t) {
    const int next = t + T::kStages - 1;
    if (next < n_tiles) {
      pipe.issue(next % T::kStages, kv_base + 2 * (next % T::kStages) * kTileBytes);
      if (next + 1 < n_tiles) pipe.lookup((w.tile_begin + next + 1) * T::kBlockN);
    }
    pipe.commit();
  };
  for (int t = 0; t < n_tiles; ++t) {
    if (deep) issue_next(t);  // the barrier ending step t - 1 freed tile t - 1's stage
    const uint32_t k_tile = kv_base + 2 * (t % T::kStages) * kTileBytes;
    pipe.wait(t, deep, k_tile);
    __syncthreads();  // tile t visible to all; every warp is done with tile t - 1's stage
    if (!deep) issue_next(t);

    const int key0 = (w.tile_begin + t) * T::kBlockN;
    float s[T::kNTiles][4];
    warp_qk<T, Pipe::kSwizzled>(s, q_addr, k_tile + k_lane);
    const bool mask = key0 + T::kBlockN > w.mask_from;
    online_softmax<T>(st, s, L.scale_log2, mask, key0 + wn * T::kWarpN, limit, lane);
    warp_pv<T, Pipe::kSwizzled>(st, s, k_tile + kTileBytes + v_lane);
    if (deep) __syncthreads();  // every warp is done with tile t's stage
  }
  ptx::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the pipeline's memory
  write_block_result<T>(st, L, w, smem);
  if (L.merge_counters != nullptr && last_block_of_group(L)) merge_partials<T>(L, w, smem);
}

template <typename T>
__global__ void __launch_bounds__(T::kThreads)
    decode_split_kernel(const __grid_constant__ DecodeLaunch L) {
  extern __shared__ __align__(128) char smem[];
  pdl_wait_then_release();  // before the first global read (q, lengths, block table)
  const BlockWork w = block_work<T>(L);
  if (w.rb * T::kBlockM >= w.rows) return;  // short sequence of a varlen batch: no rows here
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (T::kHasTma) {
    __shared__ __align__(8) uint64_t bars[T::kStages];
    if (L.tma) {
      TmaPipe<T> pipe(L, w, bars);
      split_body<T>(L, w, pipe, smem);
      return;
    }
  }
#endif
  AsyncPipe<T> pipe(L, w);
  split_body<T>(L, w, pipe, smem);
}

}  // namespace flashserve::kernels::cuda::decode
