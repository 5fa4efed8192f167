// Host side of the decode kernel's TMA path (decode_tma.h): which problems it can load, and the
// tensor maps of K and V, built per launch.
#pragma once

#include <cuda.h>

#include "flashserve/kernels/decode_attention.h"

namespace flashserve::kernels::cuda::decode {

/// Keys per TMA box for p with key tiles of block_n keys, or 0 when the TMA path cannot load p:
/// head_dim not a multiple of 64 (boxes are 64 columns), packed varlen K/V (no per-sequence
/// extent to stop a box at), pages not a power of two (a run would straddle pages), or more than
/// 32 boxes per tile (one lane of warp 0 issues each). Pages >= block_n: block_n; smaller: a page.
int tma_box_rows(const DecodeParams& p, int block_n);

/// The map of k (is_v false) or v: [pages][page rows][head_dim / 64][heads_kv][64] innermost
/// last (dense: the batch is the page), boxes of box_rows x 64 (x every slice when wide),
/// 128-byte swizzled, L2 fills of l2_bytes (0, 128 or 256). false when the driver refuses it
/// (the caller then uses cp.async).
bool make_kv_tensor_map(const DecodeParams& p, bool is_v, int box_rows, bool wide, int l2_bytes,
                        CUtensorMap* map);

}  // namespace flashserve::kernels::cuda::decode
