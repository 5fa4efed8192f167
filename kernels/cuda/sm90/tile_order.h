// The sm90 kernel's linear tile order as plain arithmetic (host and device), so that a host test
// can check it is a permutation. A tile index maps to (query tile m_idx, batch * heads_q index hb).
//  - l2_heads <= 1: the query tiles of one (batch, head) adjacent (they share K/V in L2).
//  - l2_heads > 1 (causal): FlashAttention-3's L2-sized sections: l2_heads consecutive heads whose
//    K/V fit in L2 form a section; inside it the tiles go query tile by query tile (heaviest,
//    i.e. last rows, first: the caller reverses m_idx) with the heads innermost. So the whole
//    section is longest-first (a greedy LPT list over the section, not over one head), and the
//    light tiles of a section's every head come last: the end of the grid is balanced.
#pragma once

#if defined(__CUDACC__)
#define FLASHSERVE_HD __host__ __device__ __forceinline__
#else
#define FLASHSERVE_HD inline
#endif

namespace flashserve::kernels::cuda::sm90 {

struct TileCoord {
  int m_idx, hb;
};

/// Tile `tile` of num_m * num_hb tiles in the order above.
FLASHSERVE_HD TileCoord tile_coord(int tile, int num_m, int num_hb, int l2_heads) {
  if (l2_heads <= 1) return {tile % num_m, tile / num_m};
  const int section_tiles = l2_heads * num_m;
  const int section = tile / section_tiles, within = tile % section_tiles;
  const int first_hb = section * l2_heads;
  const int heads = num_hb - first_hb < l2_heads ? num_hb - first_hb : l2_heads;
  return {within / heads, first_hb + within % heads};
}

/// Heads per L2 section for a causal problem: as many (query) heads as have their K and V within
/// kL2SectionBytes (FlashAttention-3 uses 32 MB; the H100 has 50 MB), at least 1.
constexpr long long kL2SectionBytes = 32ll << 20;
inline int l2_section_heads(long long seqlen_k, int head_dim, int elem_bytes, int q_per_kv_head,
                            int num_hb) {
  const long long kv_head_bytes = 2 * seqlen_k * head_dim * elem_bytes;
  long long heads = kv_head_bytes > 0 ? kL2SectionBytes / kv_head_bytes : num_hb;
  heads *= q_per_kv_head;  // query heads that share one K/V head share its bytes
  if (heads < 1) heads = 1;
  return heads > num_hb ? num_hb : int(heads);
}

}  // namespace flashserve::kernels::cuda::sm90
