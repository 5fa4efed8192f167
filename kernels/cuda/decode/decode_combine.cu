// Merges the split kernel's partial results: per (query row, head), LSE = log sum_s exp(LSE_s)
// and O = sum_s exp(LSE_s - LSE) O_s, written in the output dtype. One warp per (row, head).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "decode_tile_io.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {
namespace {

constexpr int kCombineWarps = 4;

__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <typename Element>
__global__ void __launch_bounds__(32 * kCombineWarps)
    decode_combine_kernel(const __grid_constant__ DecodeLaunch L) {
  const DecodeParams& p = L.p;
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  if (item >= int64_t{L.total_q} * p.heads_q) return;
  const int64_t row = item / p.heads_q;  // global query row
  const int h = static_cast<int>(item % p.heads_q);
  const int64_t split_stride = int64_t{L.total_q} * p.heads_q;
  const float* lse_s = L.lse_partial + item;

  float m = -INFINITY;
  for (int s = lane; s < L.num_splits; s += 32) m = fmaxf(m, lse_s[s * split_stride]);
  m = warp_max(m);
  float sum = 0.f;
  if (m != -INFINITY)
    for (int s = lane; s < L.num_splits; s += 32) sum += __expf(lse_s[s * split_stride] - m);
  sum = warp_sum(sum);
  const bool seen = m != -INFINITY && sum > 0.f;
  const float lse = seen ? m + __logf(sum) : -INFINITY;

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
  const float* o_s = L.o_partial + item * p.head_dim;
  for (int c = lane * 4; c < p.head_dim; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (seen) {
      for (int s = 0; s < L.num_splits; ++s) {
        const float weight = __expf(lse_s[s * split_stride] - lse);  // exp(-inf) = 0
        if (weight == 0.f) continue;  // an empty split's O is 0: skip its read
        const float4 x = *reinterpret_cast<const float4*>(o_s + s * split_stride * p.head_dim + c);
        acc.x += weight * x.x, acc.y += weight * x.y, acc.z += weight * x.z, acc.w += weight * x.w;
      }
    }
    store4(o + c, acc);
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
  if (L.p.dtype == DType::kBFloat16) {
    decode_combine_kernel<__nv_bfloat16><<<grid, 32 * kCombineWarps, 0, stream>>>(L);
  } else {
    decode_combine_kernel<__half><<<grid, 32 * kCombineWarps, 0, stream>>>(L);
  }
  return cudaGetLastError();
}

}  // namespace flashserve::kernels::cuda::decode
