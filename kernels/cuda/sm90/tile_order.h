// The sm90 kernel's linear tile order as plain arithmetic (host and device), so that a host test
// can check it is a permutation. A tile index maps to (query tile m_idx, batch * heads_q index hb).
//  - l2_heads <= 1: the query tiles of one (batch, head) adjacent (they share K/V in L2).
//  - l2_heads > 1 (causal, head_dim >= 128: schedule_l2_section_heads): FlashAttention-3's L2-sized sections: l2_heads consecutive heads whose
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

/// Where the sections are used: causal problems (their tiles differ in length, so the order
/// decides the balance at the end of the grid) at head_dim >= 128. H100 A/B (interleaved
/// medians vs cuDNN, kernels-sm90-h100-2026-11-24-d.md): d128 causal S2048 / S4096 / S8192 /
/// odd S / GQA 1.149 / 1.107-1.115 / 1.155 / 1.075 / 1.085 with sections against 1.068 /
/// 1.088-1.097 / 1.092 / 1.063 / 1.073 head after head; d64 causal S2048 / S4096 / S8192 /
/// odd S 0.984 / 1.004 / 1.019 / 0.990 against 0.998 / 1.028 / 1.025 / 1.003, so d64 keeps the
/// old order. 0 = one (batch, head) after the other.
inline int schedule_l2_section_heads(bool causal, long long seqlen_k, int head_dim, int elem_bytes,
                                     int q_per_kv_head, int num_hb) {
  if (!causal || head_dim < 128) return 0;
  return l2_section_heads(seqlen_k, head_dim, elem_bytes, q_per_kv_head, num_hb);
}

}  // namespace flashserve::kernels::cuda::sm90
