// Force-included into the fuzzers' copy of kernels/cpu/attention_forward.cc only: clang < 16
// rejects __builtin_cpu_supports("f16c") ("invalid cpu feature string"), which that file uses.
// Routes the builtin through a function that asks CPUID for F16C and the builtin for the rest.
#pragma once

#if defined(__clang__) && __clang_major__ < 16
#include <cpuid.h>
#include <cstring>

static inline bool flashserve_fuzz_cpu_supports(const char* feature) {
  if (std::strcmp(feature, "f16c") == 0) {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
  }
  if (std::strcmp(feature, "avx512f") == 0) return __builtin_cpu_supports("avx512f");
  if (std::strcmp(feature, "avx2") == 0) return __builtin_cpu_supports("avx2");
  if (std::strcmp(feature, "fma") == 0) return __builtin_cpu_supports("fma");
  return false;
}
#define __builtin_cpu_supports(feature) flashserve_fuzz_cpu_supports(feature)
#endif
