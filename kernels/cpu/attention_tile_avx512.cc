// AVX-512F tile kernel (16 floats per vector). Every function here carries the target attribute;
// the driver calls it only when __builtin_cpu_supports("avx512f") (which includes the OS check).
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own `__Y = __Y` placeholders
// (GCC bug 105593, fixed in 12.3/13); the pragma must precede the header to cover its lines.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "flashserve/kernels/float_convert.h"
#include "tile_kernel.h"

#define FLASHSERVE_TILE_TARGET __attribute__((target("avx512f,avx2,fma,f16c")))

namespace flashserve::kernels::cpu {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int kWidth = 16;
  // 32 zmm registers: scores 6 keys x 4 vectors (24 accumulators + 4 Q^T vectors), output
  // 4 rows x 4 vectors (16 accumulators + 4 V vectors).
  static constexpr int kScoreKeys = 6, kScoreVecs = 4;
  static constexpr int kOutRows = 4, kOutVecs = 4;

  FLASHSERVE_TILE_TARGET static V zero() { return _mm512_setzero_ps(); }
  FLASHSERVE_TILE_TARGET static V set1(float x) { return _mm512_set1_ps(x); }
  FLASHSERVE_TILE_TARGET static V load(const float* p) { return _mm512_loadu_ps(p); }
  FLASHSERVE_TILE_TARGET static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  FLASHSERVE_TILE_TARGET static V add(V a, V b) { return _mm512_add_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  FLASHSERVE_TILE_TARGET static V max(V a, V b) { return _mm512_max_ps(a, b); }
  FLASHSERVE_TILE_TARGET static V zero_if_neg_inf(V x) {
    const __mmask16 is_neg_inf = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(is_neg_inf, x, _mm512_setzero_ps());
  }

  // Same algorithm and constants as Avx2::exp2 (see attention_tile_avx2.cc).
  FLASHSERVE_TILE_TARGET static V exp2(V x) {
    x = _mm512_max_ps(_mm512_set1_ps(-127.f), x);
    const __m512i n = _mm512_cvtps_epi32(x);  // round to nearest even
    const V f = _mm512_sub_ps(x, _mm512_cvtepi32_ps(n));
    V poly = _mm512_set1_ps(1.535336188319500e-4f);
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.339887440266574e-3f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(9.618437357674640e-3f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(5.550332471162809e-2f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(2.402264791363012e-1f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(6.931472028550421e-1f));
    poly = _mm512_fmadd_ps(poly, f, _mm512_set1_ps(1.f));
    const V pow2n =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(poly, pow2n);
  }

  FLASHSERVE_TILE_TARGET static void convert_in(const void* src, DType dtype, float* dst, int n) {
    int i = 0;
    if (dtype == DType::kFloat32) {
      std::memcpy(dst, src, sizeof(float) * size_t(n));
      return;
    }
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if (dtype == DType::kFloat16) {
      for (; i + 16 <= n; i += 16) {
        _mm512_storeu_ps(
            dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
      }
      for (; i < n; ++i) dst[i] = half_to_float(s[i]);
    } else {
      for (; i + 16 <= n; i += 16) {
        const __m512i w =
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
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
      for (; i + 16 <= n; i += 16) {
        const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), h);
      }
      for (; i < n; ++i) d[i] = float_to_half(src[i]);
    } else {
      for (; i + 16 <= n; i += 16) {
        const V x = _mm512_loadu_ps(src + i);
        const __m512i u = _mm512_castps_si512(x);
        // Round to nearest even: add 0x7fff plus the lowest kept bit, keep the high half.
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __m512i quiet_nan =
            _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        const __m512i r = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
      }
      for (; i < n; ++i) d[i] = float_to_bf16(src[i]);
    }
  }
};

}  // namespace
}  // namespace flashserve::kernels::cpu

#include "attention_tile_impl.h"

namespace flashserve::kernels::cpu {

TileKernel tile_kernel_avx512() { return {kBlockQ, &workspace_floats<Avx512>, &run_block<Avx512>}; }

}  // namespace flashserve::kernels::cpu
