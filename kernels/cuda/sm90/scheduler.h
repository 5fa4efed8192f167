// Which tiles a block of the sm90 kernel computes, and in what order. Every schedule walks one
// linear tile order (tile_order.h: non-causal, the query tiles of one (batch, head) adjacent;
// causal, L2-sized sections of heads walked heaviest query tile first); only the producer warp
// walks it and hands each tile to the consumers through shared memory (kernel.h), so the consumers
// never compute a schedule.
//  - static (sched_slot < 0): block b takes tiles b, b + gridDim.x, ...; used for non-causal
//    fixed-length problems (equal tiles) and for one block per tile (gridDim.x = tiles).
//  - dynamic (sched_slot >= 0): each producer takes the next tile from a global counter when it
//    starts loading one, so blocks stay close together in the order (L2 reuse) and the unequal
//    causal tiles balance like a greedy longest-first list (and packed variable lengths' tiles
//    spread evenly; the 128-row kernels' producer skips those past a sequence's end, kernel.h).
//    The counters live in a pool of kSchedSlots pairs {next tile, finished blocks} per instance
//    file; counter_slots.h lends a launch a slot no running launch counts on (it stays with its
//    stream), and the launch's last block resets its pair to 0. Until session 27 the slots went
//    round-robin: 1024 launches on other streams during one long launch shared its counters.
#pragma once

#include "flashserve/kernels/attention_params.h"
#include "tile_order.h"

namespace flashserve::kernels::cuda::sm90 {

constexpr int kSchedSlots = 128;  // streams with a dynamic launch of one instance file at once
// Zero at module load; each launch leaves its pair at zero again (finish_dynamic_schedule).
static __device__ unsigned int g_sched_counters[2 * kSchedSlots];

/// The launch's schedule: slot < 0 static, else the dynamic counter slot; l2_heads: the tile
/// order's section size (tile_order.h; <= 1 keeps one (batch, head) after the other).
struct SchedArgs {
  int slot, l2_heads;
};

/// A tile's sequence: first rows in q/o and k/v along the tensor maps' row axis (0, or with
/// packed variable-length inputs cu_seqlens[sequence]), and lengths.
struct SeqSpan {
  int q_row0, k_row0, seqlen_q, seqlen_k;
};

/// One tile of work: which query tile of which (batch, head), how many K/V tiles it sees, and
/// its sequence's span; batch is the tensor maps' batch coordinate (0 when packed). first_row:
/// the tile's first query row in its sequence (query tile m: m * kBlockM - causal_shift()).
struct BlockWork {
  int first_row, head, head_kv, batch, n_blocks;
  int seqlen_q, seqlen_k, q_row0, k_row0;
};

/// Causal query tiles of T::kCausalEndAligned kernels end at the sequence's last row (aligned
/// bottom-right, as the mask is): the row padding a length that is not a multiple of kBlockM
/// needs then sits above row 0, in the first tile, which sees the fewest keys. Aligned at row 0
/// it sat in the last tile, which sees every key: 7% of a d64 causal batch of mixed lengths at
/// 192-row tiles (kernels-decode-h200-2026-11-25.md, varlen 0.912 of dense).
template <typename T>
__device__ __forceinline__ int causal_shift(bool causal, int seqlen_q) {
  if (!T::kCausalEndAligned || !causal) return 0;
  return (T::kBlockM - seqlen_q % T::kBlockM) % T::kBlockM;
}

/// The linear tile order and the work of each tile.
template <typename T>
struct TileScheduler {
  int num_m, total, l2_heads;
  __device__ TileScheduler(const AttentionParams& p, int l2_heads_)
      : num_m((p.seqlen_q + T::kBlockM - 1) / T::kBlockM),
        total(num_m * p.heads_q * p.batch),
        l2_heads(l2_heads_) {}

  /// The tile's sequence (packed inputs: read from cu_seqlens, so the producer reads it once and
  /// hands it to the consumers with the tile index, kernel.h).
  __device__ SeqSpan span(const AttentionParams& p, int tile) const {
    if constexpr (T::kPacked) {
      const int seq = tile_coord(tile, num_m, p.heads_q * p.batch, l2_heads).hb / p.heads_q;
      const int q0 = p.cu_seqlens_q[seq], k0 = p.cu_seqlens_k[seq];
      return {q0, k0, p.cu_seqlens_q[seq + 1] - q0, p.cu_seqlens_k[seq + 1] - k0};
    } else {
      return {0, 0, p.seqlen_q, p.seqlen_k};
    }
  }

  __device__ BlockWork work(const AttentionParams& p, int tile, const SeqSpan& s) const {
    BlockWork w;
    const TileCoord c = tile_coord(tile, num_m, p.heads_q * p.batch, l2_heads);
    const int m_idx = c.m_idx, hb = c.hb;
    const int m_block = p.causal ? num_m - 1 - m_idx : m_idx;
    w.first_row = m_block * T::kBlockM - causal_shift<T>(p.causal, s.seqlen_q);
    w.head = hb % p.heads_q;
    w.head_kv = w.head / (p.heads_q / p.heads_kv);
    w.batch = T::kPacked ? 0 : hb / p.heads_q;
    w.q_row0 = s.q_row0;
    w.k_row0 = s.k_row0;
    w.seqlen_q = s.seqlen_q;
    w.seqlen_k = s.seqlen_k;
    w.n_blocks = (w.seqlen_k + T::kBlockN - 1) / T::kBlockN;
    if (p.causal) {  // one past the last column the tile's last row may see
      const int col_end = w.first_row + T::kBlockM + w.seqlen_k - w.seqlen_q;
      w.n_blocks = min(w.n_blocks, col_end <= 0 ? 0 : (col_end + T::kBlockN - 1) / T::kBlockN);
    }
    // A tile past a shorter sequence's end: no rows, nothing to load or write.
    if (w.first_row >= w.seqlen_q) w.n_blocks = 0;
    return w;
  }
};

/// The producer's next tile after prev (-1: the first); >= total when the block is done.
__device__ __forceinline__ int next_tile(int sched_slot, int prev) {
  if (sched_slot < 0) return prev < 0 ? int(blockIdx.x) : prev + int(gridDim.x);
  return int(atomicAdd(&g_sched_counters[2 * sched_slot], 1u));
}

/// next_tile() for the producer warp: lane 0 takes the tile, every lane gets it.
__device__ __forceinline__ int next_tile_warp(int sched_slot, int prev) {
  if (sched_slot < 0) return next_tile(sched_slot, prev);
  int tile = 0;
  if (threadIdx.x % 32 == 0) tile = next_tile(sched_slot, prev);
  return __shfl_sync(0xffffffffu, tile, 0);
}

/// Called by each block's producer after its last next_tile(): the last block to finish resets
/// the slot's pair for a later launch (every block has taken its last tile by then).
__device__ __forceinline__ void finish_dynamic_schedule(int sched_slot) {
  if (sched_slot < 0) return;
  __threadfence();  // this block's last atomicAdd on the tile counter comes first
  if (atomicAdd(&g_sched_counters[2 * sched_slot + 1], 1u) == gridDim.x - 1) {
    atomicExch(&g_sched_counters[2 * sched_slot], 0u);
    atomicExch(&g_sched_counters[2 * sched_slot + 1], 0u);
  }
}

}  // namespace flashserve::kernels::cuda::sm90
