// Global <-> shared tile movement: cp.async copies of Q/K/V tiles into swizzled shared memory
// (zero-filled past the end of the sequence) and the O/LSE epilogue.
#pragma once

#include <cstdint>

#include "ptx.h"
#include "swizzle.h"

namespace flashserve::kernels::cuda {

/// Copies a [kRows][kHeadDim] tile whose row 0 is at gmem (row stride in elements) into the
/// swizzled shared tile smem. Thread tid moves chunk (tid % kChunksPerRow) of rows
/// tid / kChunksPerRow + i * kLoadRowStep (or, when threads do not cover whole rows, the 16-byte
/// chunks tid + i * kNThreads of the tile): consecutive threads read consecutive 16 bytes.
/// kPredicated: rows >= rows_valid are zero-filled and not read (the sequence tail).
template <typename Traits, int kRows, bool kPredicated>
__device__ __forceinline__ void load_tile(typename Traits::Element* smem,
                                          const typename Traits::Element* gmem, int64_t row_stride,
                                          int rows_valid, int tid) {
  using Swz = Swizzle<Traits::kChunksPerRow>;
  const uint32_t dst = ptx::smem_addr(smem);
  auto copy_chunk = [&](int row, int chunk, const typename Traits::Element* s) {
    const uint32_t d = dst + Swz::offset(row, chunk) * 2;
    if constexpr (kPredicated) {
      const bool valid = row < rows_valid;
      ptx::cp_async_16_zfill(d, valid ? s : gmem, valid);
    } else {
      ptx::cp_async_16(d, s);
    }
  };
  if constexpr (Traits::kRowAlignedCopy) {
    const int chunk = tid % Traits::kChunksPerRow;
    const int row0 = tid / Traits::kChunksPerRow;
    const typename Traits::Element* src = gmem + row0 * row_stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < kRows / Traits::kLoadRowStep; ++i)
      copy_chunk(row0 + i * Traits::kLoadRowStep, chunk,
                 src + int64_t(i) * Traits::kLoadRowStep * row_stride);
  } else {
    constexpr int kTotal = kRows * Traits::kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kTotal + Traits::kNThreads - 1) / Traits::kNThreads; ++i) {
      const int idx = tid + i * Traits::kNThreads;
      if (kTotal % Traits::kNThreads == 0 || idx < kTotal) {
        const int row = idx / Traits::kChunksPerRow, chunk = idx % Traits::kChunksPerRow;
        copy_chunk(row, chunk, gmem + row * row_stride + chunk * 8);
      }
    }
  }
}

/// Writes the [kBlockM][kHeadDim] tile staged in shared memory (swizzled) to global memory,
/// 16 bytes per thread and access; rows >= rows_valid are skipped.
template <typename Traits>
__device__ __forceinline__ void store_tile(const typename Traits::Element* smem,
                                           typename Traits::Element* gmem, int64_t row_stride,
                                           int rows_valid, int tid) {
  using Swz = Swizzle<Traits::kChunksPerRow>;
  constexpr int kTotal = Traits::kBlockM * Traits::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kTotal + Traits::kNThreads - 1) / Traits::kNThreads; ++i) {
    const int idx = tid + i * Traits::kNThreads;
    const int row = idx / Traits::kChunksPerRow, chunk = idx % Traits::kChunksPerRow;
    if ((kTotal % Traits::kNThreads == 0 || idx < kTotal) && row < rows_valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(smem + Swz::offset(row, chunk));
      *reinterpret_cast<uint4*>(gmem + row * row_stride + chunk * 8) = v;
    }
  }
}

}  // namespace flashserve::kernels::cuda
