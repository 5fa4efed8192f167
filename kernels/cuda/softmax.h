// Online softmax over the warp's S fragments in fp32 with exp2: p = 2^(s * scale_log2 - m *
// scale_log2), one FFMA + one EX2 per element. Each row lives in the 4 lanes of a quad, so the
// row max takes two shuffles; row sums stay per-lane until the epilogue.
// kLazy (FlashAttention-4's lazy rescale): m moves only when a tile's max exceeds it by more
// than KernelConfig::kLazyRescaleThresholdLog2 in the log2 domain, so p <= 2^threshold; the
// O/row-sum rescale (128 FMULs per tile at head_dim 128) is skipped when no row of the warp
// moves, which after the first tiles is almost always. reference::attention_emulated with
// EmulationOptions{block_n, backwards, threshold} rounds P at the same places.
#pragma once

#include <cuda_fp16.h>

#include <cmath>

#include "flashserve/kernels/kernel_config.h"
#include "ptx.h"

namespace flashserve::kernels::cuda {

/// The |M| (M = row_max * scale * log2(e)) from which a row finalizes NaN (out_of_range_sum), by
/// the type P is rounded to for P*V. p = 2^(fma(s, scale_log2, -M)) carries the rounding of M (up
/// to ulp(M) / 2) into every exponent, on top of the lazy rescale's 2^8. bf16 keeps fp32's
/// exponent range: below 2^31 every P stays within 2^+-72. fp16 ends at 65504 and is 0 below
/// 2^-24: below 2^27 P stays within [2^-4, 2^12] (from 2^29 an audit's emulation found the max
/// key's P rounded to 0 or inf). Past the limit P could overflow or vanish -- O = 0 with a finite
/// LSE, or every P 0 and the row read as one that saw no key: silent wrong answers.
template <typename Element>
inline constexpr float kMaxScaledLogit = 2147483648.f;  // 2^31
template <>
inline constexpr float kMaxScaledLogit<__half> = 134217728.f;  // 2^27

/// The row sum a row finalizes with: NaN when the row saw a key but |M| reaches `max_scaled`
/// (kMaxScaledLogit), else `sum`.
__device__ __forceinline__ float out_of_range_sum(float sum, float row_max, float scale, bool empty,
                                                  float max_scaled) {
  const float scaled = row_max * scale * 1.4426950408889634f;
  return !empty && !(fabsf(scaled) < max_scaled) ? NAN : sum;
}

template <int kMTiles, int kNTiles, int kDTiles, bool kLazy = false>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows per lane: (mi, h) -> row g + 8h of tile mi
  float row_max[kRows];  // running max of raw scores (-inf: nothing seen yet)
  float row_sum[kRows];  // this lane's part of the running sum of p

  /// Turns s into p in place and rescales o. kFirst: o is all zeros and nothing was seen
  /// before, so no rescaling is needed (the cheap first iteration).
  template <bool kFirst>
  __device__ __forceinline__ void update(float (&s)[kMTiles][kNTiles][4],
                                         float (&o)[kMTiles][kDTiles][4], float scale_log2) {
    if constexpr (kLazy && !kFirst) {
      update_lazy(s, o, scale_log2);
    } else {
      update_exact<kFirst>(s, o, scale_log2);
    }
  }

  /// FlashAttention-2's update: m moves to the tile's max whenever it grows.
  template <bool kFirst>
  __device__ __forceinline__ void update_exact(float (&s)[kMTiles][kNTiles][4],
                                               float (&o)[kMTiles][kDTiles][4], float scale_log2) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mi * 2 + h;
        float mx = kFirst ? -INFINITY : row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mi][nt][2 * h], s[mi][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // A row that has seen only masked entries keeps max -inf; subtract 0 instead so that
        // every p is 2^-inf = 0 rather than NaN.
        const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        float sum = 0.f;
        if constexpr (!kFirst) {
          const float alpha = ptx::exp2_approx(row_max[r] * scale_log2 - max_scaled);
          sum = row_sum[r] * alpha;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o[mi][dt][2 * h] *= alpha;
            o[mi][dt][2 * h + 1] *= alpha;
          }
        }
        row_max[r] = mx;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float p = ptx::exp2_approx(fmaf(s[mi][nt][2 * h + j], scale_log2, -max_scaled));
            s[mi][nt][2 * h + j] = p;
            sum += p;
          }
        row_sum[r] = sum;
      }
  }

  /// The lazy update of a tile after the first: per row, move m (rescaling O and the row sum
  /// by alpha = 2^(m_old - m_new)) only if the tile's max grows it by more than the threshold;
  /// the rescale loop runs only if some row of the warp moves (warp vote).
  __device__ __forceinline__ void update_lazy(float (&s)[kMTiles][kNTiles][4],
                                              float (&o)[kMTiles][kDTiles][4], float scale_log2) {
    float alpha[kRows];
    bool any_moves = false;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mi * 2 + h;
        float mx = row_max[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
          mx = fmaxf(mx, fmaxf(s[mi][nt][2 * h], s[mi][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float old_scaled = row_max[r] * scale_log2, new_scaled = mx * scale_log2;
        // -inf -> finite: +inf, moves (alpha = 0; O and the sum are still 0). Both -inf: NaN,
        // does not move (the row has seen only masked entries).
        const bool moves = new_scaled - old_scaled > KernelConfig::kLazyRescaleThresholdLog2;
        alpha[r] = moves ? ptx::exp2_approx(old_scaled - new_scaled) : 1.f;
        row_max[r] = moves ? mx : row_max[r];
        any_moves |= moves;
      }
    if (__any_sync(0xffffffffu, any_moves)) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mi * 2 + h;
          row_sum[r] *= alpha[r];
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            o[mi][dt][2 * h] *= alpha[r];
            o[mi][dt][2 * h + 1] *= alpha[r];
          }
        }
    }
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mi * 2 + h;
        const float max_scaled = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
        float sum = row_sum[r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float p = ptx::exp2_approx(fmaf(s[mi][nt][2 * h + j], scale_log2, -max_scaled));
            s[mi][nt][2 * h + j] = p;
            sum += p;
          }
        row_sum[r] = sum;
      }
  }

  /// Completes the row sums across the quad, scales o by 1 / sum and returns per-row LSE
  /// (natural log). A row that saw no key gets o = 0 and LSE = -inf; a row with a NaN score (a
  /// NaN input, or logits past fp32) or out of the exp2 form's range (out_of_range_sum) gets NaN
  /// in both, as the CPU does for logits past fp32.
  __device__ __forceinline__ void finalize(float (&o)[kMTiles][kDTiles][4], float scale,
                                           float max_scaled, float (&lse)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mi * 2 + h;
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        // Every key masked: max -inf and sum 0 (a NaN score -- fmaxf skips it -- leaves max -inf
        // too, but makes the sum NaN).
        const bool empty = row_max[r] == -INFINITY && sum == 0.f;
        sum = out_of_range_sum(sum, row_max[r], scale, empty, max_scaled);
        const float inv = empty ? 0.f : 1.f / sum;
        lse[r] = empty ? -INFINITY : row_max[r] * scale + logf(sum);
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mi][dt][2 * h] *= inv;
          o[mi][dt][2 * h + 1] *= inv;
        }
      }
  }
};

}  // namespace flashserve::kernels::cuda
