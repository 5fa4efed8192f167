// Online softmax over a consumer thread's share of a wgmma S accumulator (two rows per thread:
// l / 4 and l / 4 + 8 of its warp's 16; a row's values live in the 4 lanes of a quad), with the
// sm80 family's lazy rescale (kernels/cuda/softmax.h, KernelConfig::kLazyRescaleThresholdLog2).
// Split in two so that O can be rescaled after an in-flight P*V wgmma completes:
// scale_and_exp() turns S into P and returns per-row alpha; rescale_o() applies alpha to O.
#pragma once

#include <cmath>

#include "../ptx.h"
#include "../softmax.h"
#include "flashserve/kernels/kernel_config.h"

namespace flashserve::kernels::cuda::sm90 {

template <int kN, int kD>
struct Sm90Softmax {
  float row_max[2];  // running max of raw scores (-inf: nothing seen yet)
  float row_sum[2];  // this lane's part of the running sum of p

  /// Row max of s over the quad, per row h.
  __device__ __forceinline__ static float quad_max(const float (&s)[kN / 2], int h, float init) {
    float mx = init;
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    return fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  }

  /// s -> p = 2^(s * scale_log2 - m * scale_log2). kFirst: the first tile (m is its max).
  /// Later tiles move m only past the lazy threshold; alpha[h] = 2^(m_old - m_new) (1: no
  /// move) must then be applied to O with rescale_o(). Returns whether any row moved.
  template <bool kFirst>
  __device__ __forceinline__ bool scale_and_exp(float (&s)[kN / 2], float scale_log2,
                                                float (&alpha)[2]) {
    bool any_moves = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kFirst) {
        row_max[h] = quad_max(s, h, -INFINITY);
        row_sum[h] = 0.f;
        alpha[h] = 1.f;
      } else {
        const float mx = quad_max(s, h, row_max[h]);
        const float old_scaled = row_max[h] * scale_log2, new_scaled = mx * scale_log2;
        // -inf -> finite: +inf, moves (alpha = 0; O and the sum are still 0). Both -inf: NaN,
        // does not move (the row has seen only masked entries).
        const bool moves = new_scaled - old_scaled > KernelConfig::kLazyRescaleThresholdLog2;
        alpha[h] = moves ? ptx::exp2_approx(old_scaled - new_scaled) : 1.f;
        row_max[h] = moves ? mx : row_max[h];
        row_sum[h] *= alpha[h];
        any_moves |= moves;
      }
      // A row that has seen only masked entries keeps max -inf: subtract 0 so p = 0, not NaN.
      const float max_scaled = row_max[h] == -INFINITY ? 0.f : row_max[h] * scale_log2;
      float sum = row_sum[h];
#pragma unroll
      for (int i = 0; i < kN / 8; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float& x = s[4 * i + 2 * h + j];
          x = ptx::exp2_approx(fmaf(x, scale_log2, -max_scaled));
          sum += x;
        }
      row_sum[h] = sum;
    }
    return any_moves;
  }

  __device__ __forceinline__ static void rescale_o(float (&o)[kD / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        o[4 * i + 2 * h] *= alpha[h];
        o[4 * i + 2 * h + 1] *= alpha[h];
      }
  }

  /// Completes the row sums across the quad, scales o by 1 / sum and returns per-row LSE
  /// (natural log). A row that saw no key gets o = 0 and LSE = -inf; a row with a NaN score (a
  /// NaN input, or logits past fp32) or out of the exp2 form's range (out_of_range_sum in
  /// ../softmax.h) gets NaN in both, as the CPU does for logits past fp32.
  __device__ __forceinline__ void finalize(float (&o)[kD / 2], float scale, float max_scaled,
                                           float (&lse)[2]) {
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      // Every key masked (a NaN score leaves max -inf too, but makes the sum NaN).
      const bool empty = row_max[h] == -INFINITY && sum == 0.f;
      sum = out_of_range_sum(sum, row_max[h], scale, empty, max_scaled);
      inv[h] = empty ? 0.f : 1.f / sum;
      lse[h] = empty ? -INFINITY : row_max[h] * scale + logf(sum);
    }
    rescale_o(o, inv);
  }
};

}  // namespace flashserve::kernels::cuda::sm90
