// Merges the split kernel's partial results: per (query row, head), LSE = log sum_s exp(LSE_s)
// and O = sum_s exp(LSE_s - LSE) O_s, written in the output dtype. One warp per (row, head).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include <cstdint>

#include "decode_tile_io.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {
namespace {

constexpr int kCombineWarps = 4;
constexpr int kSplitsPerLane = 4;  // 128 splits (kMaxSplits) over 32 lanes
constexpr int kBatch = 32;         // partial rows loaded before their first use (one trip)

/// x[j] = the 4 partial-O columns at `col` of split s0 + j (zeros past num_splits or when
/// col < 0: a lane without columns). All loads issued before any is used.
__device__ __forceinline__ void load_partials(float4 (&x)[kBatch], const float* o_s, int s0,
                                              int col, int num_splits, int64_t split_elems) {
#pragma unroll
  for (int j = 0; j < kBatch; ++j)
    x[j] = col >= 0 && s0 + j < num_splits
               ? *reinterpret_cast<const float4*>(o_s + (s0 + j) * split_elems + col)
               : make_float4(0.f, 0.f, 0.f, 0.f);
}

/// The row's LSE over its splits, and each lane's weights exp(LSE_s - LSE) of splits lane,
/// lane + 32, lane + 64, lane + 96 (0 for an empty split, LSE_s = -inf, or a row with no key).
/// A NaN partial LSE (a NaN score in that split) makes every weight and the LSE NaN: fmaxf and
/// the weights would otherwise skip it, and the row's answer would depend on the split count.
__device__ __forceinline__ float combine_weights(const float* lse_s, int64_t split_stride,
                                                 int num_splits, int lane,
                                                 float (&weight_l)[kSplitsPerLane]) {
  float lse_l[kSplitsPerLane];
  float m = -INFINITY;
  bool poisoned = false;
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) {
    const int s = lane + 32 * i;
    lse_l[i] = s < num_splits ? lse_s[s * split_stride] : -INFINITY;
    poisoned |= lse_l[i] != lse_l[i];
    m = fmaxf(m, lse_l[i]);
  }
  if (__any_sync(0xffffffffu, poisoned)) {
#pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) weight_l[i] = CUDART_NAN_F;
    return CUDART_NAN_F;
  }
  m = warp_max(m);
  float sum = 0.f;
  if (m != -INFINITY)
#pragma unroll
    for (int i = 0; i < kSplitsPerLane; ++i) sum += __expf(lse_l[i] - m);
  sum = warp_sum(sum);
  const bool seen = m != -INFINITY && sum > 0.f;
#pragma unroll
  for (int i = 0; i < kSplitsPerLane; ++i) weight_l[i] = seen ? __expf(lse_l[i] - m) / sum : 0.f;
  return seen ? m + __logf(sum) : -INFINITY;
}

/// acc += sum_j weight(s0 + j) * x[j]; the weights are shuffled from the lanes that hold them
/// (every lane must call). An empty split (weight 0) adds nothing, whatever its partial holds; a
/// NaN weight (a poisoned row) makes the sum NaN.
__device__ __forceinline__ void accumulate(float4& acc, const float4 (&x)[kBatch], int s0,
                                           const float (&weight_l)[kSplitsPerLane],
                                           int num_splits) {
#pragma unroll
  for (int j = 0; j < kBatch; ++j) {
    const int s = s0 + j;  // warp-uniform
    const float held = s < 32 ? weight_l[0] : s < 64 ? weight_l[1] : s < 96 ? weight_l[2] : weight_l[3];
    const float weight = s < num_splits ? __shfl_sync(0xffffffffu, held, s % 32) : 0.f;
    if (weight != 0.f) {
      acc.x += weight * x[j].x, acc.y += weight * x[j].y;
      acc.z += weight * x[j].z, acc.w += weight * x[j].w;
    }
  }
}

template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps)
    decode_combine_kernel(const __grid_constant__ DecodeLaunch L) {
  pdl_wait_then_release();  // the split kernel's partials are complete and visible after this
  const DecodeParams& p = L.p;
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  if (item >= int64_t{L.total_q} * p.heads_q) return;
  const int64_t row = item / p.heads_q;  // global query row
  const int h = static_cast<int>(item % p.heads_q);
  const int64_t split_stride = int64_t{L.total_q} * p.heads_q;
  const float* lse_s = L.lse_partial + item;
  const float* o_s = L.o_partial + item * p.head_dim;

  // One DRAM round trip for up to kBatch splits: the first column chunk's partial O rows are
  // loaded together with the LSEs, before the weights are known (the combine is latency-bound:
  // one warp per row). Run 5 waited for the LSEs first: 3 trips at 32 splits, 5.8 us vs cuDNN's
  // 3.1 us reduction at B1 Sk128k.
  const int64_t split_elems = split_stride * p.head_dim;
  float4 first[kBatch];
  load_partials(first, o_s, 0, lane * 4 < p.head_dim ? lane * 4 : -1, L.num_splits, split_elems);

  float weight_l[kSplitsPerLane];
  const float lse = combine_weights(lse_s, split_stride, L.num_splits, lane, weight_l);

  int b = 0, qi = 0;
  int64_t o_off = 0;
  if (p.cu_seqlens_q != nullptr) {
    o_off = row * p.o_row_stride;
  } else {
    b = static_cast<int>(row / p.seqlen_q);
    qi = static_cast<int>(row % p.seqlen_q);
    o_off = b * p.o_batch_stride + int64_t{qi} * p.o_row_stride;
  }
  Element* o = static_cast<Element*>(p.o) + o_off + h * p.o_head_stride;
  // Every lane runs every step (the weights come by shuffle), loading and storing only where
  // its 4 columns exist: at head_dim < 128 some lanes have none. Chunk 0 is peeled so that
  // `first` is dead before the next batch's registers are needed.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  accumulate(acc, first, 0, weight_l, L.num_splits);
  for (int c0 = 0; c0 < p.head_dim; c0 += 128) {
    const int c = c0 + lane * 4;
    const bool mine = c < p.head_dim;
    if (c0 > 0) acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = c0 == 0 ? kBatch : 0; s0 < L.num_splits; s0 += kBatch) {
      float4 x[kBatch];
      load_partials(x, o_s, s0, mine ? c : -1, L.num_splits, split_elems);
      accumulate(acc, x, s0, weight_l, L.num_splits);
    }
    if (mine) store4(o + c, acc);
  }
  if (lane == 0 && p.lse != nullptr) {
    const int64_t index = p.cu_seqlens_q != nullptr
                              ? int64_t{h} * L.total_q + row
                              : (int64_t{b} * p.heads_q + h) * p.seqlen_q + qi;
    p.lse[index] = lse;
  }
}

}  // namespace

cudaError_t launch_decode_combine(const DecodeLaunch& L, cudaStream_t stream) {
  const int64_t items = int64_t{L.total_q} * L.p.heads_q;
  const int64_t blocks = (items + kCombineWarps - 1) / kCombineWarps;
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  constexpr int kThreads = 32 * kCombineWarps;
  if (L.p.dtype == DType::kBFloat16)
    return launch_decode_grid(decode_combine_kernel<__nv_bfloat16>, grid, kThreads, 0, L, stream);
  return launch_decode_grid(decode_combine_kernel<__half>, grid, kThreads, 0, L, stream);
}

}  // namespace flashserve::kernels::cuda::decode
