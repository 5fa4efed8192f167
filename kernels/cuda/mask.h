// Which (query row, key column) pairs of a tile may attend: the key-sequence tail and the
// bottom-right-aligned causal diagonal (FlashAttention-2 >= 2.1).
#pragma once

namespace flashserve::kernels::cuda {

/// Query row i may attend key column j iff j < col_limit(i), where
/// col_limit(i) = seqlen_k, or min(seqlen_k, i + 1 + seqlen_k - seqlen_q) when causal.
struct Mask {
  int seqlen_k;
  int causal_offset;  // seqlen_k - seqlen_q
  bool causal;

  __device__ __forceinline__ int col_limit(int row) const {
    return causal ? min(seqlen_k, row + 1 + causal_offset) : seqlen_k;
  }

  /// True when key tile [n_block * block_n, (n_block + 1) * block_n) has a column some row of
  /// the query tile whose first row is first_row must not see: such tiles take the masked path.
  __device__ __forceinline__ bool tile_needs_mask(int first_row, int n_block, int block_n) const {
    const int col_end = (n_block + 1) * block_n;  // one past the tile's last column
    if (col_end > seqlen_k) return true;
    return causal && col_end > first_row + 1 + causal_offset;
  }

  /// Sets to -inf the entries of the warp's S fragments (kMTiles x kNTiles x 4, layout in
  /// gemm.h) whose column is at or past their row's limit. row0: global row of the warp's first
  /// row; col0: global column of the tile's first column.
  template <int kMTiles, int kNTiles>
  __device__ __forceinline__ void apply(float (&s)[kMTiles][kNTiles][4], int row0, int col0,
                                        int lane) const {
    const int row_in = lane / 4;
    const int col_in = col0 + (lane % 4) * 2;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int limit = col_limit(row0 + mi * 16 + h * 8 + row_in) - col_in;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (nt * 8 + j >= limit) s[mi][nt][2 * h + j] = -INFINITY;
      }
  }
};

}  // namespace flashserve::kernels::cuda
