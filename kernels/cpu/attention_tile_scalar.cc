// Portable tile kernel (plain C++, one float per "vector"): the fallback for x86-64 CPUs
// without AVX2/FMA/F16C.
#include <cmath>
#include <cstdint>

#include "flashserve/kernels/float_convert.h"
#include "tile_kernel.h"

#define FLASHSERVE_TILE_TARGET

namespace flashserve::kernels::cpu {
namespace {

struct Scalar {
  using V = float;
  static constexpr int kWidth = 1;
  static constexpr int kScoreKeys = 4, kScoreVecs = 4;  // 4 keys x 4 queries
  static constexpr int kOutRows = 4, kOutVecs = 4;      // 4 rows x 4 head_dim columns

  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V exp2(V x) { return std::exp2(x); }
  static V zero_if_neg_inf(V x) { return x == -INFINITY ? 0.f : x; }

  static void convert_in(const void* src, DType dtype, float* dst, int n) {
    for (int i = 0; i < n; ++i) dst[i] = load_element(src, i, dtype);
  }
  static void convert_out(const float* src, int n, void* dst, DType dtype) {
    for (int i = 0; i < n; ++i) store_element(dst, i, dtype, src[i]);
  }
};

}  // namespace
}  // namespace flashserve::kernels::cpu

#include "attention_tile_impl.h"

namespace flashserve::kernels::cpu {

TileKernel tile_kernel_scalar() { return {kBlockQ, &workspace_floats<Scalar>, &run_block<Scalar>}; }

}  // namespace flashserve::kernels::cpu
