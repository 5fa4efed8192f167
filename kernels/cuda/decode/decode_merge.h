// The split kernel's in-place merge: the last block of each (sequence, KV head, row block) to
// store its partial merges all splits' partials of its rows into the final O and LSE, so no
// combine kernel runs after the split kernel. That saves the combine's launch and the wait for
// the whole split grid to drain; each group's merge overlaps the other groups' work. By default
// only small merges take it (decode_merge_plan.cu: up to 8 KB of partials per block; larger ones
// measured even with the combine kernel).
#pragma once

#include <math_constants.h>

#include <cstdint>

#include "decode_merge_plan.h"  // merge_header_bytes
#include "decode_tile_io.h"
#include "decode_traits.h"
#include "ptx.h"

namespace flashserve::kernels::cuda::decode {

/// Whether this block is the last of its group to finish. Called by every thread once its
/// partial is stored. atom.inc wraps the group's counter from num_splits - 1 back to 0, so a
/// launch leaves its counters as it found them (zero) for the next launch in the slot.
__device__ __forceinline__ bool last_block_of_group(const DecodeLaunch& L) {
  __shared__ int last;
  __syncthreads();  // every partial store of the block is issued
  if (threadIdx.x == 0) {
    // Release: the block's partials (ordered before by the barrier) are visible to whoever sees
    // this count; acquire: the last block sees every other block's partials.
    unsigned* counter = L.merge_counters + blockIdx.z * gridDim.y + blockIdx.y;
    const unsigned top = unsigned(L.num_splits - 1);
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n"
                 : "=r"(old)
                 : "l"(counter), "r"(top)
                 : "memory");
    last = old == top;
  }
  __syncthreads();
  return last;
}

/// Row r of the block's packed rows: its query position and query head.
struct PackedRow {
  int qi, h;
};

template <typename T>
__device__ __forceinline__ PackedRow packed_row(const DecodeLaunch& L, const BlockWork& w, int r) {
  const int packed = w.rb * T::kBlockM + r;
  return {packed / L.group, w.hkv * L.group + packed % L.group};
}

/// Index of split s's partial row for (qi, h) in L.lse_partial (times head_dim: L.o_partial).
__device__ __forceinline__ int64_t partial_row(const DecodeLaunch& L, const BlockWork& w, int s,
                                               PackedRow row) {
  return (int64_t{s} * L.total_q + w.q_row0 + row.qi) * L.p.heads_q + row.h;
}

/// Walks the flat indices start, start + kStride, ... of an [outer][inner] array as (outer,
/// inner) pairs, without a division per step: the merge loops' address arithmetic ran one or two
/// runtime divisions per 16-byte copy before (session 27).
template <int kStride>
struct FlatWalk {
  int outer, inner;
  const int inner_n, step_outer, step_inner;
  __device__ __forceinline__ FlatWalk(int start, int n)
      : outer(start / n),
        inner(start % n),
        inner_n(n),
        step_outer(kStride / n),
        step_inner(kStride % n) {}
  __device__ __forceinline__ void next() {
    outer += step_outer;
    inner += step_inner;
    if (inner >= inner_n) inner -= inner_n, ++outer;
  }
};

/// s_row[r] = the partial row index of split 0 for the block's row r (split s: + s x the
/// partial rows per split), so the merge loops need no per-copy division by the GQA group.
template <typename T>
__device__ __forceinline__ void partial_row_bases(const DecodeLaunch& L, const BlockWork& w,
                                                  int rows, int64_t* s_row) {
  if (int(threadIdx.x) < rows)
    s_row[threadIdx.x] = partial_row(L, w, 0, packed_row<T>(L, w, threadIdx.x));
  __syncthreads();
}

/// s_w[s * rows + r] = the weight exp(LSE_s - LSE) of split s in row r (0 for an empty split or
/// a row that saw no key); writes each row's LSE. One warp per row.
template <typename T>
__device__ void merge_weights(const DecodeLaunch& L, const BlockWork& w, int rows,
                              const int64_t* s_row, float* s_w) {
  const int lane = threadIdx.x % 32, n = L.num_splits;
  const int64_t split_rows = int64_t{L.total_q} * L.p.heads_q;
  FlatWalk<T::kThreads> at(threadIdx.x, rows);  // (split, row)
#pragma unroll 1
  for (int i = threadIdx.x; i < n * rows; i += T::kThreads, at.next())
    s_w[i] = __ldcg(L.lse_partial + at.outer * split_rows + s_row[at.inner]);
  __syncthreads();
  for (int r = threadIdx.x / 32; r < rows; r += T::kWarps) {
    float m = -INFINITY;
    bool nan_split = false;
    for (int s = lane; s < n; s += 32) {
      const float lse = s_w[s * rows + r];
      nan_split |= lse != lse;
      m = fmaxf(m, lse);
    }
    // A NaN partial (a NaN score in that split) poisons the row, as in the combine kernel.
    const bool poisoned = __any_sync(0xffffffffu, nan_split);
    m = warp_max(m);
    float sum = 0.f;
    if (m != -INFINITY)
      for (int s = lane; s < n; s += 32) sum += __expf(s_w[s * rows + r] - m);
    sum = warp_sum(sum);
    const bool seen = m != -INFINITY && sum > 0.f;
    for (int s = lane; s < n; s += 32)
      s_w[s * rows + r] = poisoned ? CUDART_NAN_F
                          : seen   ? __expf(s_w[s * rows + r] - m) / sum
                                   : 0.f;
    const PackedRow row = packed_row<T>(L, w, r);
    if (lane == 0 && L.p.lse != nullptr)
      L.p.lse[lse_index(L, w.b, row.qi, row.h, w.q_row0)] = poisoned ? CUDART_NAN_F
                                                            : seen   ? m + __logf(sum)
                                                                     : -INFINITY;
  }
  __syncthreads();
}

/// Merges the partials of the block's rows (the group's last block; pipeline memory is free):
/// weights from the LSEs, then O = sum_s weight_s O_s over every split's partial rows, staged
/// in shared memory by cp.async first (one round trip; run_decode takes this path only where
/// they fit: plan_in_kernel_merge). `#pragma unroll 1`: unrolled, these loops cost the d64
/// 128-key 3-stage kernel 25 registers (138 -> 163) in its main loop.
template <typename T>
__device__ void merge_partials(const DecodeLaunch& L, const BlockWork& w, char* smem) {
  using Element = typename T::Element;
  constexpr int kQuads = T::kHeadDim / 4;  // float4 columns of a row
  const int n = L.num_splits;
  const int rows = min(T::kBlockM, w.rows - w.rb * T::kBlockM);
  const int row_quads = rows * kQuads;
  int64_t* s_row = reinterpret_cast<int64_t*>(smem);
  float* s_w = reinterpret_cast<float*>(s_row + T::kBlockM);
  float* s_o = reinterpret_cast<float*>(
      smem + merge_header_bytes(T::kBlockM, n, rows));  // [split][row][column]
  partial_row_bases<T>(L, w, rows, s_row);
  const float4* partials = reinterpret_cast<const float4*>(L.o_partial);
  const int64_t split_quads = int64_t{L.total_q} * L.p.heads_q * kQuads;
  FlatWalk<T::kThreads> at(threadIdx.x, row_quads);  // (split, row x column quad)
#pragma unroll 1
  for (int i = threadIdx.x; i < n * row_quads; i += T::kThreads, at.next()) {
    const int64_t quad = s_row[at.inner / kQuads] * kQuads + at.inner % kQuads;
    ptx::cp_async_16(ptx::smem_addr(s_o + 4 * i), partials + at.outer * split_quads + quad);
  }
  ptx::cp_async_commit();
  merge_weights<T>(L, w, rows, s_row, s_w);  // its LSE loads overlap the copies in flight
  ptx::cp_async_wait<0>();
  __syncthreads();

  Element* o = static_cast<Element*>(L.p.o);
  for (int i = threadIdx.x; i < row_quads; i += T::kThreads) {  // (row, column quad)
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
    for (int s = 0; s < n; ++s) {
      const float weight = s_w[s * rows + i / kQuads];
      if (weight != 0.f) {  // an empty split adds nothing, whatever its partial holds (NaN: all)
        const float4 x = *reinterpret_cast<const float4*>(s_o + 4 * (s * row_quads + i));
        acc.x += weight * x.x, acc.y += weight * x.y;
        acc.z += weight * x.z, acc.w += weight * x.w;
      }
    }
    const PackedRow row = packed_row<T>(L, w, i / kQuads);
    store4(o + w.o_off + row.qi * L.p.o_row_stride + row.h * L.p.o_head_stride + (i % kQuads) * 4,
           acc);
  }
}

}  // namespace flashserve::kernels::cuda::decode
