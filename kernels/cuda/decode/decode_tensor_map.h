// Host side of the decode kernel's TMA path (decode_tma.h): which problems it can load, and the
// tensor maps of K and V, built per launch.
#pragma once

#include <cuda.h>

#include "flashserve/kernels/decode_attention.h"

namespace flashserve::kernels::cuda::decode {

/// Columns per TMA slice of a K/V row (decode_tma.h): 64 (128-byte rows, 128-byte swizzle) when
/// head_dim is a multiple of 64, else 32 (64-byte rows, 64-byte swizzle: d32, d96), so that shared
/// memory holds only the row's real columns. The tensor maps and the kernels' addresses
/// (DecodeTraits::kSliceCols) both take it from here.
constexpr int tma_slice_cols(int head_dim) { return head_dim % 64 == 0 ? 64 : 32; }

/// Keys per TMA box for p with key tiles of block_n keys, or 0 when the TMA path cannot load p:
/// head_dim not a multiple of 32 (boxes are slices of 64 or 32 columns, tma_slice_cols), packed
/// varlen K/V (no per-sequence extent to stop a box at), pages not a power of two (a run would
/// straddle pages), or more than 32 boxes per tile (one lane of warp 0 issues each). Pages >=
/// block_n: block_n; smaller: a page. (Which kernels carry the path: DecodeTraits::kHasTma.)
int tma_box_rows(const DecodeParams& p, int block_n);

/// The map of k (is_v false) or v: [pages][page rows][slices][heads_kv][slice columns] innermost
/// last (dense: the batch is the page; slice columns tma_slice_cols(head_dim)), boxes of
/// box_rows x one slice (x every slice when wide), swizzled by the slice's row width (128 or
/// 64 bytes), L2 fills of l2_bytes (0, 128 or 256). false when the driver refuses it (the caller
/// then uses cp.async).
bool make_kv_tensor_map(const DecodeParams& p, bool is_v, int box_rows, bool wide, int l2_bytes,
                        CUtensorMap* map);

}  // namespace flashserve::kernels::cuda::decode
