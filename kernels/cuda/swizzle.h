// XOR swizzle of 16-byte chunks in a row-major [rows][head_dim] 16-bit shared-memory tile, so
// that ldmatrix (8 rows x 16 B) and the cp.async tile writes hit 32 distinct banks.
#pragma once

namespace flashserve::kernels::cuda {

/// kChunksPerRow = head_dim / 8. Chunk c of row r lives at chunk c ^ (r & kMask) of that row.
/// kMask is 7 when rows hold a multiple of 8 chunks (head_dim 64, 128, 256: conflict-free);
/// smaller widths (head_dim 32, 96) use the largest power of two that divides the row
/// (correct, with some 2-way conflicts).
template <int kChunksPerRow>
struct Swizzle {
  static constexpr int kMask = (kChunksPerRow % 8 == 0) ? 7 : (kChunksPerRow % 4 == 0) ? 3 : 1;
  static_assert(kChunksPerRow % 2 == 0, "rows must hold an even number of 16-byte chunks");

  /// Element offset of (row, chunk) within the tile.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return row * kChunksPerRow * 8 + ((chunk ^ (row & kMask)) << 3);
  }
};

}  // namespace flashserve::kernels::cuda
