// Host-side conversions between float and the 16-bit float formats (round to nearest even),
// plus typed element access. Used by the CPU backend, the references and the tests.
#pragma once

#include <cstdint>
#include <cstring>

#include "flashserve/kernels/dtype.h"

namespace flashserve::kernels {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t{h} << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;        // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;       // rounds to >= 65520: inf
  if (abs < 0x38800000u) {                             // below 2^-14: subnormal or zero
    // Scale so that one half-subnormal ulp (2^-24) becomes 1.0, then round to nearest even
    // through float addition (exact for these magnitudes).
    const float scaled = bits_float(abs) * 16777216.0f;  // * 2^24
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;  // RNE to integer (< 2^23)
    return sign | static_cast<uint16_t>(rounded);
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits (nearest even).
  uint32_t v = abs - 0x38000000u;  // exponent bias 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

/// Rounds a float to the nearest value representable in dtype.
inline float round_to_dtype(float f, DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return half_to_float(float_to_half(f));
    case DType::kBFloat16:
      return bf16_to_float(float_to_bf16(f));
    case DType::kFloat32:
      return f;
  }
  return f;
}

inline float load_element(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return half_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat32:
      return static_cast<const float*>(base)[index];
  }
  return 0.f;
}

inline void store_element(void* base, int64_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[index] = float_to_half(value);
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[index] = float_to_bf16(value);
      return;
    case DType::kFloat32:
      static_cast<float*>(base)[index] = value;
      return;
  }
}

}  // namespace flashserve::kernels
