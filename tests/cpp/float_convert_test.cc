// float <-> fp16/bf16 conversions: exhaustive round trips, round-to-nearest-even against an
// independent reference, ties, subnormals, overflow, inf and NaN.
#include "flashserve/kernels/float_convert.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace flashserve::kernels {
namespace {

// fp16 value of a bit pattern from its definition (independent of half_to_float).
double half_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  double magnitude;
  if (exp == 0x1f) {
    magnitude =
        mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exp == 0) {
    magnitude = std::ldexp(double(mant), -24);
  } else {
    magnitude = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return sign ? -magnitude : magnitude;
}

// Round-to-nearest-even of x to fp16 by search over all finite halves (independent reference).
uint16_t half_reference(float x) {
  static const std::vector<double> positives = [] {
    std::vector<double> v;
    for (uint16_t h = 0; h < 0x7c00; ++h) v.push_back(half_value(h));  // ascending
    return v;
  }();
  if (std::isnan(x)) return 0x7e00;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::abs(double(x));
  // Values >= 65520 (halfway between 65504 and the next step 65536) round to infinity.
  if (a >= 65520.0) return sign | 0x7c00;
  const auto it = std::lower_bound(positives.begin(), positives.end(), a);
  if (it == positives.end()) return sign | 0x7bff;  // (65504, 65520): nearer the largest finite
  const uint16_t hi = static_cast<uint16_t>(it - positives.begin());
  if (*it == a || hi == 0) return sign | hi;
  const uint16_t lo = hi - 1;
  const double d_lo = a - positives[lo], d_hi = positives[hi] - a;
  if (d_lo < d_hi) return sign | lo;
  if (d_hi < d_lo) return sign | hi;
  return sign | ((lo & 1) ? hi : lo);  // tie: even mantissa
}

TEST(FloatConvert, HalfRoundTripsAll65536Patterns) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = half_to_float(h);
    const double expected = half_value(h);
    if (std::isnan(expected)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << bits;
      const uint16_t back = float_to_half(f);
      ASSERT_EQ(back & 0x7c00, 0x7c00) << std::hex << bits;
      ASSERT_NE(back & 0x3ff, 0) << std::hex << bits;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << bits;
      continue;
    }
    ASSERT_EQ(double(f), expected) << std::hex << bits;
    ASSERT_EQ(float_to_half(f), h) << std::hex << bits;
  }
}

TEST(FloatConvert, Bf16RoundTripsAll65536Patterns) {
  for (uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    const float f = bf16_to_float(h);
    ASSERT_EQ(float_bits(f), bits << 16) << std::hex << bits;
    const uint16_t back = float_to_bf16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(back))) << std::hex << bits;  // quieted, never inf
      ASSERT_EQ(back & 0x8000, h & 0x8000);
    } else {
      ASSERT_EQ(back, h) << std::hex << bits;
    }
  }
}

TEST(FloatConvert, HalfRoundingMatchesReferenceOnMantissaBoundaries) {
  // Every float exponent that matters for fp16 (subnormal to overflow), with the 13 dropped
  // mantissa bits at and around the rounding boundaries, plus random low bits.
  const uint32_t low_bits[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x17ff, 0x0800};
  std::mt19937 rng(std::random_device{}());
  for (uint32_t exp = 90; exp <= 145; ++exp) {
    for (uint32_t high = 0; high < 1024; ++high) {
      for (uint32_t low : low_bits) {
        for (uint32_t sign : {0u, 1u}) {
          const uint32_t bits = (sign << 31) | (exp << 23) | (high << 13) | low;
          const float x = bits_float(bits);
          ASSERT_EQ(float_to_half(x), half_reference(x)) << std::hex << bits;
        }
      }
      const float x = bits_float((exp << 23) | (high << 13) | (rng() & 0x1fff));
      ASSERT_EQ(float_to_half(x), half_reference(x)) << std::hex << float_bits(x);
    }
  }
}

TEST(FloatConvert, RoundsTiesToEven) {
  // fp16 near 1: spacing 2^-10.
  EXPECT_EQ(float_to_half(1.f + std::ldexp(1.f, -11)), 0x3c00);      // tie -> even (1.0)
  EXPECT_EQ(float_to_half(1.f + 3 * std::ldexp(1.f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(float_to_half(1.f + std::ldexp(1.f, -11) + std::ldexp(1.f, -20)), 0x3c01);  // above tie
  // bf16 near 1: spacing 2^-7.
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(1.f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.f + 3 * std::ldexp(1.f, -8)), 0x3f82);
  EXPECT_EQ(float_to_bf16(1.f + std::ldexp(1.f, -8) + std::ldexp(1.f, -20)), 0x3f81);
  EXPECT_EQ(float_to_bf16(-1.f - std::ldexp(1.f, -8)), 0xbf80);
}

TEST(FloatConvert, HalfSubnormalsAndOverflow) {
  const float tiny = std::ldexp(1.f, -24);  // smallest fp16 subnormal
  EXPECT_EQ(half_to_float(0x0001), tiny);
  EXPECT_EQ(half_to_float(0x03ff), 1023 * tiny);
  EXPECT_EQ(half_to_float(0x0400), std::ldexp(1.f, -14));
  EXPECT_EQ(float_to_half(tiny), 0x0001);
  EXPECT_EQ(float_to_half(tiny / 2), 0x0000);              // tie -> even (zero)
  EXPECT_EQ(float_to_half(3 * tiny / 2), 0x0002);          // tie -> even (2)
  EXPECT_EQ(float_to_half(tiny / 2 + tiny / 16), 0x0001);  // above the tie
  EXPECT_EQ(float_to_half(-tiny / 4), 0x8000);             // negative zero
  EXPECT_EQ(float_to_half(1023.5f * tiny), 0x0400);        // rounds up into the normals
  EXPECT_EQ(float_to_half(std::ldexp(1.f, -30)), 0x0000);
  EXPECT_EQ(float_to_half(65504.f), 0x7bff);
  EXPECT_EQ(float_to_half(65519.f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.f), 0x7c00);  // halfway to 65536: overflows
  EXPECT_EQ(float_to_half(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(
      std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::signaling_NaN()))));
}

TEST(FloatConvert, Bf16SubnormalsInfAndNan) {
  const float denorm_min = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(float_to_bf16(denorm_min), 0x0000);              // below half an ulp
  EXPECT_EQ(float_to_bf16(bits_float(0x00008000)), 0x0000);  // tie -> even
  EXPECT_EQ(float_to_bf16(bits_float(0x00018000)), 0x0002);  // tie -> even (up)
  EXPECT_EQ(bf16_to_float(0x0001), bits_float(0x00010000));
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(float_to_bf16(bits_float(0x7f7f7fff)), 0x7f7f);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  // A NaN whose payload sits only in the dropped bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7f800001)))));
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0xffffffff)))));
}

TEST(FloatConvert, TypedElementAccessAndRoundToDtype) {
  uint16_t h[2] = {};
  float f[2] = {};
  store_element(h, 1, DType::kFloat16, 0.1f);
  EXPECT_EQ(h[0], 0);
  EXPECT_EQ(h[1], float_to_half(0.1f));
  EXPECT_EQ(load_element(h, 1, DType::kFloat16), half_to_float(float_to_half(0.1f)));
  store_element(h, 0, DType::kBFloat16, 0.1f);
  EXPECT_EQ(load_element(h, 0, DType::kBFloat16), bf16_to_float(float_to_bf16(0.1f)));
  store_element(f, 1, DType::kFloat32, 0.1f);
  EXPECT_EQ(load_element(f, 1, DType::kFloat32), 0.1f);
  EXPECT_EQ(round_to_dtype(0.1f, DType::kFloat32), 0.1f);
  EXPECT_EQ(round_to_dtype(0.1f, DType::kFloat16), half_to_float(float_to_half(0.1f)));
  EXPECT_EQ(round_to_dtype(0.1f, DType::kBFloat16), bf16_to_float(float_to_bf16(0.1f)));
  EXPECT_NE(round_to_dtype(0.1f, DType::kFloat16), 0.1f);
}

}  // namespace
}  // namespace flashserve::kernels
