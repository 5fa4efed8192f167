// AVX2 + FMA + F16C tile kernel (8 floats per vector). Every function here carries the target
// attribute; the driver calls it only when __builtin_cpu_supports says the CPU has these.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashserve/kernels/float_convert.h"
#include "tile_kernel.h"

#define FLASHSERVE_TILE_TARGET __attribute__((target("avx2,fma,f16c")))

namespace flashserve::kernels::cpu {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int kWidth = 8;
  // 16 ymm registers: scores 6 keys x 2 vectors (12 accumulators), output 4 rows x 3 vectors (12).
  static constexpr int kScoreKeys = 6, kScoreVecs = 2;
  static constexpr int kOutRows = 4, kOutVecs = 3;

  FLASHSERVE_TILE_TARGET static V zero() { return _mm256_setzero_ps(); }
  FLASHSERVE_TILE_TARGET static V set1(float x) { return _mm256_set1_ps(x); }
  FLASHSERVE_TILE_TARGET static V load(const float* p) { return _mm256_loadu_ps(p); }
  FLASHSERVE_TILE_TARGET static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  FLASHSERVE_TILE_TARGET static V add(V a, V b) { return _mm256_add_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  FLASHSERVE_TILE_TARGET static V max(V a, V b) { return _mm256_max_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V zero_if_neg_inf(V x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), x);
  }

  // 2^x for x <= 0: x = n + f with n = round(x), f in [-1/2, 1/2]; 2^f by Cephes' degree-6
  // polynomial (relative error < 2e-7); 2^n built in the exponent field. x <= -127 gives exactly 0
  // (n = -127 makes the exponent field 0); NaN stays NaN (max returns its second operand on NaN).
  FLASHSERVE_TILE_TARGET static V exp2(V x) {
    x = _mm256_max_ps(_mm256_set1_ps(-127.f), x);
    const __m256i n = _mm256_cvtps_epi32(x);  // round to nearest even
    const V f = _mm256_sub_ps(x, _mm256_cvtepi32_ps(n));
    V poly = _mm256_set1_ps(1.535336188319500e-4f);
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(1.339887440266574e-3f));
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(9.618437357674640e-3f));
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(5.550332471162809e-2f));
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(2.402264791363012e-1f));
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(6.931472028550421e-1f));
    poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(1.f));
    const V pow2n =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(poly, pow2n);
  }

  FLASHSERVE_TILE_TARGET static void convert_in(const void* src, DType dtype, float* dst, int n) {
    int i = 0;
    if (dtype == DType::kFloat32) {
      std::memcpy(dst, src, sizeof(float) * size_t(n));
      return;
    }
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if (dtype == DType::kFloat16) {
      for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
      }
      for (; i < n; ++i) dst[i] = half_to_float(s[i]);
    } else {
      for (; i + 8 <= n; i += 8) {
        const __m256i w =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
      for (; i < n; ++i) dst[i] = bf16_to_float(s[i]);
    }
  }

  FLASHSERVE_TILE_TARGET static void convert_out(const float* src, int n, void* dst, DType dtype) {
    int i = 0;
    if (dtype == DType::kFloat32) {
      std::memcpy(dst, src, sizeof(float) * size_t(n));
      return;
    }
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (dtype == DType::kFloat16) {
      for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
      }
      for (; i < n; ++i) d[i] = float_to_half(src[i]);
    } else {
      for (; i + 8 <= n; i += 8) {
        const V x = _mm256_loadu_ps(src + i);
        const __m256i u = _mm256_castps_si256(x);
        // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the high half.
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        const __m256i quiet_nan =
            _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, quiet_nan, is_nan);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_castsi256_si128(packed));
      }
      for (; i < n; ++i) d[i] = float_to_bf16(src[i]);
    }
  }
};

}  // namespace
}  // namespace flashserve::kernels::cpu

#include "attention_tile_impl.h"

namespace flashserve::kernels::cpu {

TileKernel tile_kernel_avx2() { return {kBlockQ, &workspace_floats<Avx2>, &run_block<Avx2>}; }

}  // namespace flashserve::kernels::cpu
