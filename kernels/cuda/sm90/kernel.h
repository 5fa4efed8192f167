// The sm90 flash-attention forward kernel (FlashAttention-3 structure, written from scratch in
// raw PTX): a persistent grid of thread blocks of 1 + C warpgroups (C = T::kConsumers, 2 or 3),
// each computing (64 * C-row query tile, head, batch) tiles in the order scheduler.h gives
// (static or dynamic, see launch.h); the producer hands each tile's index to the consumers with
// its Q buffer (two where they fit) and loads the next tile's Q and K/V while the consumers
// finish the current one.
//  - Warpgroup 0 (producer, setmaxnreg 40, or 32 beside 3 consumers): its warp 0 hands each
//    tile's index to the consumers (named barriers) and its lane 0 issues TMA copies of the Q
//    tile and of the K and V tiles, last tile first, into a kStages-deep shared-memory ring; each
//    copy completes on a "full" mbarrier, and a stage is reused once the consumers arrive on its
//    "empty" mbarrier.
//  - Warpgroups 1..C (consumers, setmaxnreg 232, or 160 when C = 3) each own 64 query rows:
//    S = Q K^T by wgmma with both operands in shared memory, the online softmax (lazy rescale) in
//    registers, and O += P V by wgmma with P from registers. Within a warpgroup the softmax of K/V
//    tile j runs while the tensor cores do P V of tile j - 1 (issued together with S_j), and the
//    consumer warpgroups take turns issuing their GEMMs (round robin on named barriers 1..C).
// Epilogue: O goes through the tile's Q buffer to TMA stores (store_o); with packed
// variable-length inputs (T::kPacked) a warpgroup whose rows cross the sequence's end writes them
// row by row instead (store_o_rows).
// Causal 192-row query tiles end at the sequence's last row (scheduler.h's causal_shift), so the
// first may start above row 0: TMA fills those Q rows with zeros (or, packed, loads the previous
// sequence's); they are computed like any row and nothing of theirs is stored.
// K/V tiles are visited from the last one backwards, as in the sm80 family, so the masked tiles
// (key tail, causal diagonal) come first; TMA fills rows past the tensor's end with zeros (packed
// inputs: rows past a sequence's end belong to the next one, see clear_foreign_v_rows).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <type_traits>

#include "../mask.h"
#include "../ptx.h"
#include "flashserve/kernels/attention_params.h"
#include "ptx_sm90.h"
#include "scheduler.h"
#include "softmax_sm90.h"
#include "traits.h"
#include "wgmma_ops.h"

namespace flashserve::kernels::cuda::sm90 {

/// Shared-memory addresses of one block's Q buffers, K/V ring and mbarriers.
template <typename T>
struct SmemMap {
  static constexpr int kQB = T::kQBuffers;
  uint32_t q0, k, v, bars;
  __device__ explicit SmemMap(uint32_t base)
      : q0(base + T::kQOffset),
        k(base + T::kKOffset),
        v(base + T::kVOffset),
        bars(base + T::kBarOffset) {}
  __device__ uint32_t q(int b) const { return q0 + b * T::kQBytes; }
  __device__ uint32_t q_loaded(int b) const { return bars + 8 * b; }
  __device__ uint32_t q_empty(int b) const { return bars + 8 * (kQB + b); }
  __device__ uint32_t k_full(int s) const { return bars + 8 * (2 * kQB + s); }
  __device__ uint32_t v_full(int s) const { return bars + 8 * (2 * kQB + T::kStages + s); }
  __device__ uint32_t k_empty(int s) const { return bars + 8 * (2 * kQB + 2 * T::kStages + s); }
  __device__ uint32_t v_empty(int s) const { return bars + 8 * (2 * kQB + 3 * T::kStages + s); }
  // The tile handed to the consumers with Q buffer b: its index (-1: no more tiles), then,
  // packed inputs only, its SeqSpan (4 words).
  __device__ uint32_t tile_slot(int b) const {
    return bars + 8 * T::kNumBarriers + T::kTileSlotBytes * b;
  }
  __device__ uint32_t k_stage(int s) const { return k + s * T::kKVBytes; }
  __device__ uint32_t v_stage(int s) const { return v + s * T::kKVBytes; }
};

// Named barriers (bar.sync ids, 16 per block), for C = T::kConsumers consumer warpgroups:
// 0 __syncthreads; 1..C the consumers' GEMM turns (turn_bar); C+1..2C each consumer
// warpgroup's epilogue (epilogue_bar); then the tile-slot hand-over: "full" per (Q buffer b,
// consumer warpgroup cw) (the producer warp wrote the slot; each warpgroup waits on its own, so
// none waits for another) and "empty" per Q buffer (every warpgroup read the slot; only the
// producer waits). C = 3, two Q buffers: ids up to 2C + 2C + 2 = 14.
// The hand-over used to ride on the Q mbarriers only; that orders it in the PTX memory model,
// but compute-sanitizer racecheck does not model an mbarrier wait as happens-before for plain
// shared-memory accesses and reported the slot's write/read pair as 2 hazards. Named barriers
// (FlashAttention-3's tile-count hand-over) are both correct and visible to racecheck.
template <typename T>
__device__ __forceinline__ int turn_bar(int cw) {
  return 1 + cw;
}
template <typename T>
__device__ __forceinline__ int epilogue_bar(int cw) {
  return 1 + T::kConsumers + cw;
}
template <typename T>
__device__ __forceinline__ int slot_full_bar(int b, int cw) {
  return 1 + 2 * T::kConsumers + T::kConsumers * b + cw;
}
template <typename T>
__device__ __forceinline__ int slot_empty_bar(int b) {
  return 1 + 2 * T::kConsumers + T::kConsumers * T::kQBuffers + b;
}
constexpr int kSlotFullThreads = 32 + 128;  // the producer warp + one consumer warpgroup
template <typename T>
constexpr int kSlotEmptyThreads = 32 + 128 * T::kConsumers;  // + every consumer warpgroup

/// Producer warp: writes tile (or -1) and, packed inputs, its sequence's span into Q buffer b's
/// slot once every consumer warpgroup has read the slot's previous value (round >= 1), and
/// releases it to them.
template <typename T>
__device__ void hand_over_tile(const SmemMap<T>& sm, int b, int round, int tile,
                               const SeqSpan& span) {
  static_assert(T::kQBuffers <= 2 && 4 * T::kConsumers + T::kQBuffers < 16, "barrier ids");
  __syncwarp();
  if (round > 0) named_barrier_sync(slot_empty_bar<T>(b), kSlotEmptyThreads<T>);
  if (threadIdx.x == 0) {
    const uint32_t slot = sm.tile_slot(b);
    st_shared_b32(slot, uint32_t(tile));
    if constexpr (T::kPacked) {
      st_shared_b32(slot + 4, uint32_t(span.q_row0));
      st_shared_b32(slot + 8, uint32_t(span.k_row0));
      st_shared_b32(slot + 12, uint32_t(span.seqlen_q));
      st_shared_b32(slot + 16, uint32_t(span.seqlen_k));
    }
  }
  __syncwarp();
#pragma unroll
  for (int cw = 0; cw < T::kConsumers; ++cw)
    named_barrier_arrive(slot_full_bar<T>(b, cw), kSlotFullThreads);
}

/// Producer warp, after the last hand-over (q_iters slots written, the last one -1): waits for
/// the consumers' reads it has not waited for yet, so no named barrier is left half-arrived.
template <typename T>
__device__ void drain_slot_reads(int q_iters) {
  __syncwarp();
  for (int it = q_iters - T::kQBuffers; it < q_iters - 1; ++it) {
    if (it >= 0) named_barrier_sync(slot_empty_bar<T>(it % T::kQBuffers), kSlotEmptyThreads<T>);
  }
}

/// Consumer warpgroup cw: the tile handed over with Q buffer b (-1: no more tiles) and, packed
/// inputs, its sequence's span (so the consumers read no cu_seqlens on their critical path).
template <typename T>
__device__ int take_tile(const SmemMap<T>& sm, int b, int cw, SeqSpan& span) {
  __syncwarp();  // bar.sync is .aligned: the warp's lanes together (store_o diverges lane 0)
  named_barrier_sync(slot_full_bar<T>(b, cw), kSlotFullThreads);
  const uint32_t slot = sm.tile_slot(b);
  const int tile = int(ld_shared_b32(slot));
  if constexpr (T::kPacked) {
    span = {int(ld_shared_b32(slot + 4)), int(ld_shared_b32(slot + 8)),
            int(ld_shared_b32(slot + 12)), int(ld_shared_b32(slot + 16))};
  }
  if (tile >= 0) named_barrier_arrive(slot_empty_bar<T>(b), kSlotEmptyThreads<T>);
  return tile;
}

/// Producer warp (warp 0): lane 0 issues every TMA copy of every tile of the block, in the
/// order next_tile() gives (scheduler.h); the whole warp waits on the mbarriers and takes part
/// in the tile hand-over (named barriers need whole warps). Per tile: K[last] (its ring stage
/// frees before a Q buffer does), then, once the consumers have stored the O that Q buffer
/// q_iter % kQBuffers last staged, the tile's index into the buffer's slot and its Q copy, then
/// K[j + 1], V[j] pairs, so the consumers' next S = Q K^T never waits behind a V copy. A tile no
/// row of which sees a key is handed over without copies (its rows get O = 0, LSE = -inf), a
/// packed tile with no rows not at all, and the end of the block's work as tile -1. kv_iter
/// counts K/V tiles over all of the block's work: tile kv_iter uses stage kv_iter % kStages in
/// round kv_iter / kStages.
template <typename T>
__device__ void produce(const AttentionParams& p, const SmemMap<T>& sm, const CUtensorMap* tm_q,
                        const CUtensorMap* tm_k, const CUtensorMap* tm_v, SchedArgs sa) {
  const bool leader = threadIdx.x == 0;
  if (leader) {
    tma_prefetch_descriptor(tm_q);
    tma_prefetch_descriptor(tm_k);
    tma_prefetch_descriptor(tm_v);
  }
  const TileScheduler<T> sched(p, sa.l2_heads);
  int kv_iter = 0, q_iter = 0;
  for (int tile = next_tile_warp(sa.slot, -1);; tile = next_tile_warp(sa.slot, tile), ++q_iter) {
    bool done;
    SeqSpan span;
    BlockWork w;
    auto look_up = [&] {
      done = tile >= sched.total;
      span = sched.span(p, done ? 0 : tile);
      w = sched.work(p, done ? 0 : tile, span);
    };
    // Packed: a tile past its sequence's end has no rows; handed over, it would hold a Q buffer
    // and a hand-over round, and the next tile's Q could not load ahead. Take the next one
    // (kSkipsRowlessTiles: not in the 192-row kernels, whose producer has 32 registers).
    for (look_up(); T::kSkipsRowlessTiles && !done && w.first_row >= w.seqlen_q; look_up())
      tile = next_tile_warp(sa.slot, tile);
    const bool loads = !done && w.n_blocks > 0;
    auto load = [&](const CUtensorMap* tm, bool is_k, int j) {
      const int g = kv_iter + j, s = g % T::kStages;
      mbarrier_wait(is_k ? sm.k_empty(s) : sm.v_empty(s), ((g / T::kStages) & 1) ^ 1);
      if (!leader) return;
      const uint32_t full = is_k ? sm.k_full(s) : sm.v_full(s);
      const uint32_t dst = is_k ? sm.k_stage(s) : sm.v_stage(s);
      mbarrier_arrive_expect_tx(full, T::kKVBytes);
#pragma unroll
      for (int cb = 0; cb < T::kColBlocks; ++cb)
        tma_load_4d(dst + cb * T::kBlockN * T::kRowBytes, tm, full, cb * 64,
                    w.k_row0 + (w.n_blocks - 1 - j) * T::kBlockN, w.head_kv, w.batch);
    };
    if (loads) load(tm_k, true, 0);
    // A fresh empty barrier counts as having completed the round before round 0 (parity 1).
    const int qb = q_iter % T::kQBuffers;
    mbarrier_wait(sm.q_empty(qb), ((q_iter / T::kQBuffers) & 1) ^ 1);
    hand_over_tile<T>(sm, qb, q_iter / T::kQBuffers, done ? -1 : tile, span);
    if (!loads) {
      if (leader) mbarrier_arrive(sm.q_loaded(qb));  // keeps the buffer's phases in step
      if (done) break;
      continue;
    }
    if (leader) {
      mbarrier_arrive_expect_tx(sm.q_loaded(qb), T::kQBytes);
#pragma unroll
      for (int cb = 0; cb < T::kColBlocks; ++cb)
        tma_load_4d(sm.q(qb) + cb * T::kBlockM * T::kRowBytes, tm_q, sm.q_loaded(qb), cb * 64,
                    w.q_row0 + w.first_row, w.head, w.batch);
    }
    for (int j = 1; j < w.n_blocks; ++j) {
      load(tm_k, true, j);
      load(tm_v, false, j - 1);
    }
    load(tm_v, false, w.n_blocks - 1);
    kv_iter += w.n_blocks;
  }
  drain_slot_reads<T>(q_iter + 1);
  if (leader) finish_dynamic_schedule(sa.slot);
}

/// Where row `row` (of w's sequence) of w's head starts in p.o, and its LSE entry (LSE is
/// [batch, heads_q, seqlen_q], or [heads_q, total_q] with packed variable-length inputs).
template <typename T>
__device__ __forceinline__ typename T::Element* o_row(const AttentionParams& p, const BlockWork& w,
                                                      int row) {
  return static_cast<typename T::Element*>(p.o) + int64_t(w.batch) * p.o_batch_stride +
         int64_t(w.q_row0 + row) * p.o_row_stride + int64_t(w.head) * p.o_head_stride;
}
template <typename T>
__device__ __forceinline__ int64_t lse_index(const AttentionParams& p, const BlockWork& w,
                                             int row) {
  return T::kPacked ? int64_t(w.head) * p.total_q + w.q_row0 + row
                    : (int64_t(w.batch) * p.heads_q + w.head) * p.seqlen_q + row;
}

/// A warpgroup's rows that cross its sequence's start (causal tiles above row 0, scheduler.h's
/// causal_shift) or, packed variable-length outputs, its end (TMA would clip rows only at 0 and
/// total_q, and the rows there belong to the neighbouring sequences): its rows of O (staged in
/// shared memory at base, swizzled as store_o wrote them) go out row by row, 16 bytes per thread
/// and step, from row 0 to the sequence's end and head_dim; then Q buffer qb is released at once
/// (nothing asynchronous reads it).
template <typename T>
__device__ void store_o_rows(const AttentionParams& p, const SmemMap<T>& sm, const BlockWork& w,
                             int cw, int qb, uint32_t base) {
  const int t = threadIdx.x % 128, first = w.first_row + cw * T::kRowsPerConsumer;
  const int skip = max(0, -first), chunks = p.head_dim / 8;  // rows above the sequence's start
  const int rows = min(T::kRowsPerConsumer, w.seqlen_q - first) - skip;
  for (int idx = t; idx < rows * chunks; idx += 128) {
    const int r = skip + idx / chunks, c = idx % chunks;
    const uint32_t addr =
        base + (c / 8) * T::kBlockM * T::kRowBytes + r * T::kRowBytes + ((c % 8) ^ (r % 8)) * 16;
    *reinterpret_cast<uint4*>(o_row<T>(p, w, first + r) + c * 8) = ld_shared_v4(addr);
  }
  named_barrier_sync(epilogue_bar<T>(cw), 128);  // every row has been read
  if (t == 0) mbarrier_arrive(sm.q_empty(qb));
}

/// Epilogue of consumer warpgroup cw: its normalized 64 x kHeadDim rows of O go into its rows of
/// the tile's Q buffer qb (free: every S = Q K^T of the tile has completed) in the 128-byte
/// swizzled layout, and one thread stores them with one TMA store per 64-column block (rows past
/// seqlen_q are clipped by the tensor map; store_o_rows only where the warpgroup's rows cross
/// the sequence's start, or packed, its end: every tile row by row left d64 causal S1024 at 0.92
/// of dense, kernels-varlen-h100-2026-11-25.md). That thread releases the Q buffer once the
/// store has read it: at once with one Q buffer, else at the next tile's first softmax
/// (pending_release), so the warpgroup does not wait for the read here. LSE goes straight to
/// global memory.
template <typename T>
__device__ void store_o(const AttentionParams& p, const SmemMap<T>& sm, const CUtensorMap* tm_o,
                        const BlockWork& w, int cw, int qb, const float (&o)[T::kHeadDim / 2],
                        const float (&lse)[2], uint32_t& pending_release) {
  const int lane = threadIdx.x % 32;
  const int row_in_wg = ((threadIdx.x / 32) % 4) * 16 + lane / 4;  // + 8 h
  const uint32_t base = sm.q(qb) + cw * T::kRowsPerConsumer * T::kRowBytes;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_in_wg + 8 * h;  // r % 8 == lane / 4: the swizzle's XOR
#pragma unroll
    for (int i2 = 0; i2 < T::kHeadDim / 8; ++i2) {
      const uint32_t addr = base + (i2 / 8) * T::kBlockM * T::kRowBytes + r * T::kRowBytes +
                            (((i2 % 8) ^ (lane / 4)) * 16) + (lane % 4) * 4;
      st_shared_b32(addr,
                    ptx::pack2<typename T::Element>(o[4 * i2 + 2 * h], o[4 * i2 + 2 * h + 1]));
    }
    const int row = w.first_row + cw * T::kRowsPerConsumer + r;
    if (p.lse != nullptr && lane % 4 == 0 && row >= 0 && row < w.seqlen_q)
      p.lse[lse_index<T>(p, w, row)] = lse[h];
  }
  fence_proxy_async_smem();
  named_barrier_sync(epilogue_bar<T>(cw), 128);  // the warpgroup's rows are all in smem
  const int first = w.first_row + cw * T::kRowsPerConsumer;
  if ((T::kCausalEndAligned && first < 0) ||
      (T::kPacked && first + T::kRowsPerConsumer > w.seqlen_q))
    return store_o_rows<T>(p, sm, w, cw, qb, base);
  if (threadIdx.x % 128 != 0) return;
#pragma unroll
  for (int cb = 0; cb < T::kColBlocks; ++cb)
    tma_store_4d(tm_o, base + cb * T::kBlockM * T::kRowBytes, cb * 64,
                 w.q_row0 + first, w.head, w.batch);
  bulk_commit_group();
  if constexpr (T::kQBuffers == 1) {  // the producer waits for this buffer to load the next Q
    bulk_wait_group_read0();
    mbarrier_arrive(sm.q_empty(qb));
  } else {
    pending_release = sm.q_empty(qb);
  }
}

/// The previous tile's Q buffer, once its O store has read it (store_o's pending_release).
__device__ __forceinline__ void release_stored_q(uint32_t& pending_release) {
  if (pending_release == 0) return;
  bulk_wait_group_read0();
  mbarrier_arrive(pending_release);
  pending_release = 0;
}

/// Consumer warpgroup cw (0..C-1): its 64 query rows against every K/V tile of the block.
/// kv_iter / q_iter: the block's K/V tiles and Q tiles consumed before this tile (as produce()).
template <typename T>
__device__ void consume_tile(const AttentionParams& p, const SmemMap<T>& sm,
                             const CUtensorMap* tm_o, const BlockWork& w, int cw, int kv_iter,
                             int q_iter, uint32_t& pending_release) {
  using Element = typename T::Element;
  constexpr int kN = T::kBlockN, kD = T::kHeadDim;
  const int lane = threadIdx.x % 32;
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int row0 = w.first_row + cw * T::kRowsPerConsumer + warp_in_wg * 16 + lane / 4;
  const Mask mask{w.seqlen_k, w.seqlen_k - w.seqlen_q, p.causal};
  const int col_limit[2] = {mask.col_limit(row0), mask.col_limit(row0 + 8)};
  const float scale_log2 = p.softmax_scale_log2;

  // Descriptors: Q (A, K-major) and K (B, K-major) step 32 bytes per k16 inside a 128-byte
  // row and jump a column block every 4 steps; V (B, N-major) steps 16 rows (2048 bytes).
  const int qb = q_iter % T::kQBuffers;
  auto q_desc = [&](int ks) {
    return smem_desc_sw128(sm.q(qb) + (ks / 4) * T::kBlockM * T::kRowBytes +
                               cw * T::kRowsPerConsumer * T::kRowBytes + (ks % 4) * 32,
                           16, 1024);
  };
  auto k_desc = [&](int s, int ks) {
    return smem_desc_sw128(sm.k_stage(s) + (ks / 4) * kN * T::kRowBytes + (ks % 4) * 32, 16, 1024);
  };
  auto v_desc = [&](int s, int ks) {
    return smem_desc_sw128(sm.v_stage(s) + ks * 16 * T::kRowBytes, kN * T::kRowBytes, 1024);
  };

  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  uint32_t pa[kN / 16][4];  // P of the previous tile as wgmma A fragments
  Sm90Softmax<kN, kD> softmax;

  // j: the tile's j-th K/V tile (key block n_blocks - 1 - j); g: its index over the block's work.
  auto issue_s = [&](float(&s)[kN / 2], int j) {
    const int g = kv_iter + j, stage = g % T::kStages;
    mbarrier_wait(sm.k_full(stage), (g / T::kStages) & 1);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks)
      Wgmma<Element, kN>::ss(s, q_desc(ks), k_desc(stage, ks), ks > 0);
    wgmma_commit();
  };
  // Packed inputs: the rows of the first K/V tile past the sequence's end hold the next
  // sequence's keys and values. Their P is 0, but 0 * (an Inf or NaN there) is NaN, so
  // warpgroup 0 zeroes those V rows before any P V reads them (the GEMM turns order the others
  // after it); dense inputs get zeros from TMA's out-of-bounds fill.
  const int tail_rows = w.seqlen_k - (w.n_blocks - 1) * kN;
  auto clear_foreign_v_rows = [&](int stage) {
    const uint32_t v = sm.v_stage(stage);
    for (int i = threadIdx.x % 128; i < (kN - tail_rows) * 8 * T::kColBlocks; i += 128) {
      const int row = tail_rows + i / (8 * T::kColBlocks), rest = i % (8 * T::kColBlocks);
      st_shared_zero_v4(v + (rest / 8) * kN * T::kRowBytes + row * T::kRowBytes + (rest % 8) * 16);
    }
    fence_proxy_async_smem();  // the zeros, written by threads, are read by wgmma
    named_barrier_sync(epilogue_bar<T>(cw), 128);
  };
  auto issue_pv = [&](int j) {
    const int g = kv_iter + j, stage = g % T::kStages;
    mbarrier_wait(sm.v_full(stage), (g / T::kStages) & 1);
#pragma unroll
    for (int i2 = 0; i2 < kD / 2; ++i2) fence_operand(o[i2]);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kN / 16; ++ks) Wgmma<Element, kD>::rs(o, pa[ks], v_desc(stage, ks));
    wgmma_commit();
  };
  // Ping-pong: the consumer warpgroups take turns issuing their GEMMs, round robin (named
  // barriers turn_bar), so one warpgroup's softmax runs while the tensor cores work on the
  // others' GEMMs.
  auto take_turn = [&] { named_barrier_sync(turn_bar<T>(cw), 2 * 128); };
  auto pass_turn = [&] {
    named_barrier_arrive(turn_bar<T>(cw + 1 == T::kConsumers ? 0 : cw + 1), 2 * 128);
  };
  auto release = [&](uint32_t empty_bar) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty_bar);
  };
  auto apply_mask = [&](float(&s)[kN / 2], int n_block) {
    const int col0 = n_block * kN + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < kN / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j)
          if (col0 + 8 * i + j >= col_limit[h]) s[4 * i + 2 * h + j] = -INFINITY;
  };
  auto to_pa = [&](const float(&s)[kN / 2]) {
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        pa[kk][r] = ptx::pack2<Element>(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]);
  };

  auto stage_of = [&](int j) { return (kv_iter + j) % T::kStages; };
  {  // Tile 0 (the last K/V tile): masked, no rescale.
    float s[kN / 2];
    take_turn();
    issue_s(s, 0);
    pass_turn();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) fence_operand(s[i]);
    release(sm.k_empty(stage_of(0)));
    apply_mask(s, w.n_blocks - 1);
    float alpha[2];
    softmax.template scale_and_exp<true>(s, scale_log2, alpha);
    to_pa(s);
    // Here, not in issue_pv: a check there sits in the main loop (d64 packed: 542 instead of 460
    // instructions per key block, where the warps are close to issue-bound).
    if (T::kPacked && cw == 0 && tail_rows < kN) {
      mbarrier_wait(sm.v_full(stage_of(0)), (kv_iter / T::kStages) & 1);
      clear_foreign_v_rows(stage_of(0));
    }
  }
  release_stored_q(pending_release);  // the previous tile's O store has long read its buffer
  // Tile i: S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight together; the softmax of S_i runs
  // while P V is still on the tensor cores; O is rescaled once P V has completed.
  auto step = [&](int i, auto mask_tag) {
    float s[kN / 2];
    take_turn();
    issue_s(s, i);
    issue_pv(i - 1);
    pass_turn();
    wgmma_wait<1>();  // S_i done
#pragma unroll
    for (int i2 = 0; i2 < kN / 2; ++i2) fence_operand(s[i2]);
    release(sm.k_empty(stage_of(i)));
    if constexpr (decltype(mask_tag)::value) apply_mask(s, w.n_blocks - 1 - i);
    float alpha[2];
    const bool moves = softmax.template scale_and_exp<false>(s, scale_log2, alpha);
    wgmma_wait<0>();  // P_{i-1} V_{i-1} done: O and pa are ours again
#pragma unroll
    for (int i2 = 0; i2 < kD / 2; ++i2) fence_operand(o[i2]);
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) fence_operand(pa[kk][r]);
    release(sm.v_empty(stage_of(i - 1)));
    if (__any_sync(0xffffffffu, moves)) Sm90Softmax<kN, kD>::rescale_o(o, alpha);
    to_pa(s);
  };
  int i = 1;
  for (; i < w.n_blocks && mask.tile_needs_mask(w.first_row, w.n_blocks - 1 - i, kN); ++i)
    step(i, std::true_type{});
  for (; i < w.n_blocks; ++i) step(i, std::false_type{});
  take_turn();
  issue_pv(w.n_blocks - 1);
  pass_turn();
  wgmma_wait<0>();
#pragma unroll
  for (int i2 = 0; i2 < kD / 2; ++i2) fence_operand(o[i2]);
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) fence_operand(pa[kk][r]);
  release(sm.v_empty(stage_of(w.n_blocks - 1)));

  float lse[2];
  softmax.finalize(o, p.softmax_scale, kMaxScaledLogit<Element>, lse);
  store_o<T>(p, sm, tm_o, w, cw, qb, o, lse, pending_release);
}

/// A tile no row of which sees a key (causal with seqlen_q > seqlen_k): O = 0, LSE = -inf.
/// Written by the consumer threads (thread index t of kThreads).
template <typename T>
__device__ void write_empty_tile(const AttentionParams& p, const BlockWork& w, int t) {
  constexpr int kThreads = 128 * T::kConsumers;
  using Element = typename T::Element;
  const int first = max(0, w.first_row);  // causal_shift: the first tile starts above row 0
  const int rows = min(T::kBlockM, w.seqlen_q - w.first_row) - (first - w.first_row);
  const int chunks = p.head_dim / 8;  // p's, not the instance's (kernel_head_dim, registry.h)
  Element* out = o_row<T>(p, w, first);
  for (int idx = t; idx < rows * chunks; idx += kThreads)
    *reinterpret_cast<uint4*>(out + (idx / chunks) * p.o_row_stride + (idx % chunks) * 8) =
        make_uint4(0, 0, 0, 0);
  if (p.lse != nullptr)
    for (int r = t; r < rows; r += kThreads)
      p.lse[lse_index<T>(p, w, first + r)] = -INFINITY;
}

/// Consumer warpgroup cw's share of every tile the producer hands to the block.
template <typename T>
__device__ void consume(const AttentionParams& p, const SmemMap<T>& sm, const CUtensorMap* tm_o,
                        int cw, int l2_heads) {
  const TileScheduler<T> sched(p, l2_heads);
  // Warpgroup 0 has the first turn: the last warpgroup hands it over before its own first wait.
  if (cw == T::kConsumers - 1) named_barrier_arrive(turn_bar<T>(0), 2 * 128);
  int kv_iter = 0;
  uint32_t pending_release = 0;  // see store_o
  for (int q_iter = 0;; ++q_iter) {
    const int qb = q_iter % T::kQBuffers;
    SeqSpan span;
    const int tile = take_tile<T>(sm, qb, cw, span);
    if (tile < 0) break;
    mbarrier_wait(sm.q_loaded(qb), (q_iter / T::kQBuffers) & 1);
    const BlockWork w = sched.work(p, tile, T::kPacked ? span : sched.span(p, tile));
    if (w.n_blocks <= 0) {
      release_stored_q(pending_release);
      write_empty_tile<T>(p, w, int(threadIdx.x) - 128);
      named_barrier_sync(epilogue_bar<T>(cw), 128);  // the warpgroup is done with this tile
      if (threadIdx.x % 128 == 0) mbarrier_arrive(sm.q_empty(qb));
      continue;
    }
    consume_tile<T>(p, sm, tm_o, w, cw, kv_iter, q_iter, pending_release);
    kv_iter += w.n_blocks;
  }
  // The last warpgroup handed over one turn more than warpgroup 0 took: take it, so that no
  // barrier is left half-arrived when the block exits.
  if (cw == 0) named_barrier_sync(turn_bar<T>(0), 2 * 128);
  if (threadIdx.x % 128 == 0) bulk_wait_group0();  // the last O stores have completed
}

/// Persistent: grid = (launch_sm90's block count), block = kNThreads, dynamic shared memory
/// T::kSmemBytes. The tensor maps (tensor_map.h) view q/k/v/o as [batch][heads][seqlen][head_dim]
/// with p's strides and 128-byte-swizzled boxes of [rows][64] (o: 64-row boxes, one per
/// consumer warpgroup).
template <typename T>
__global__ void __launch_bounds__(T::kNThreads, 1)
    sm90_fwd_kernel(const __grid_constant__ AttentionParams p,
                    const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_o, SchedArgs sa) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const SmemMap<T> sm((ptx::smem_addr(smem_raw) + 1023u) & ~1023u);
  const int warpgroup = __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0);
  if (threadIdx.x == 0) {
    for (int b = 0; b < T::kQBuffers; ++b) {
      mbarrier_init(sm.q_loaded(b), 1);
      mbarrier_init(sm.q_empty(b), T::kConsumers);  // each warpgroup's O store has read it
    }
    for (int s = 0; s < T::kStages; ++s) {
      mbarrier_init(sm.k_full(s), 1);
      mbarrier_init(sm.v_full(s), 1);
      mbarrier_init(sm.k_empty(s), 4 * T::kConsumers);
      mbarrier_init(sm.v_empty(s), 4 * T::kConsumers);
    }
    fence_barrier_init();
  }
  __syncthreads();
  if (warpgroup == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x < 32) produce<T>(p, sm, &tm_q, &tm_k, &tm_v, sa);
  } else {
    setmaxnreg_inc<T::kConsumerRegs>();
    consume<T>(p, sm, &tm_o, warpgroup - 1, sa.l2_heads);
  }
#endif
}

}  // namespace flashserve::kernels::cuda::sm90
