// launch_sm90<Traits>: builds the Q/K/V/O tensor maps, picks the grid and its schedule and
// launches sm90_fwd_kernel (Traits' packed variable-length variant for packed inputs). Included
// only by the instance files (compiled for sm_90a); the dispatch table sees registry.h.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../counter_slots.h"
#include "../smem_limit.h"
#include "kernel.h"
#include "registry.h"
#include "tensor_map.h"

namespace flashserve::kernels::cuda::sm90 {

/// The grid and its schedule (scheduler.h): persistent, one block per SM (the producer loads
/// the next tile while the consumers finish the current one). Non-causal problems take the
/// static schedule (equal tiles), causal and packed variable-length ones the dynamic schedule (a
/// global tile counter; the static one when no counter slot is free).
/// H100 A/B in one process (bench/results/kernels-sm90-h100-2026-11-24-b.md), d128 causal
/// S4096 / S4000 / S8192: dynamic 573-611 / 546-563 / 605-611 TFLOPS, the static list (block
/// count coprime with the tiles per head) 547-557 / 533 / -, one block per tile 531-537 /
/// 498-502 / 575-585. The static list lets blocks drift apart in the tile order and thrash L2
/// on long causal problems (S8192 516-544, S16k 499-500 in the first call).
struct GridPlan {
  int blocks;
  bool dynamic;
};

inline GridPlan grid_plan(const AttentionParams& p, int tiles, int sm_count) {
  // Packed variable lengths: tiles past a shorter sequence's end are empty, so tiles differ as
  // in causal problems (H100, 16 mixed lengths, non-causal: static 0.76-0.83 of the dense
  // problem of equal work; kernels-varlen-h100-2026-11-24-sm90.md).
  return {std::min(tiles, std::max(sm_count, 1)), p.causal || p.varlen()};
}

/// The tile order's L2 section (tile_order.h; schedule_l2_heads decides where it is used).
template <typename T>
int schedule_l2_heads(const AttentionParams& p) {
  return schedule_l2_section_heads(p.causal, p.seqlen_k, T::kHeadDim,
                                   int(sizeof(typename T::Element)), p.heads_q / p.heads_kv,
                                   p.heads_q * p.batch);
}

namespace {  // internal linkage, like g_sched_counters: each instance file lends its own pool
/// A counter slot of this instance file's pool for a dynamic launch on stream (counter_slots.h;
/// slot -1: none free, or a capturing stream: the static schedule runs, also correct).
CounterSlot lend_sched_slot(cudaStream_t stream) {
  void* pool = nullptr;
  if (cudaGetSymbolAddress(&pool, g_sched_counters) != cudaSuccess) return {};
  return acquire_counter_slot(pool, kSchedSlots, stream);
}
}  // namespace

/// One kernel variant (T::kPacked or not): tensor maps, grid, launch.
template <typename T>
cudaError_t launch_sm90_kernel(const AttentionParams& p, cudaStream_t stream) {
  constexpr auto kernel = sm90_fwd_kernel<T>;
  if (cudaError_t err = raise_smem_limit<kernel>(int(T::kSmemBytes)); err != cudaSuccess)
    return err;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  if (cudaError_t err = make_tensor_map(q_view(p), T::kBlockM, &tm_q); err != cudaSuccess)
    return err;
  if (cudaError_t err = make_tensor_map(k_view(p), T::kBlockN, &tm_k); err != cudaSuccess)
    return err;
  if (cudaError_t err = make_tensor_map(v_view(p), T::kBlockN, &tm_v); err != cudaSuccess)
    return err;
  if (cudaError_t err = make_tensor_map(o_view(p), T::kRowsPerConsumer, &tm_o); err != cudaSuccess)
    return err;
  int device = 0, sm_count = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess)
    return err;
  const int tiles_per_head = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  const int64_t tiles = int64_t(tiles_per_head) * p.heads_q * p.batch;
  if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  const GridPlan plan = grid_plan(p, int(tiles), sm_count);
  const CounterSlot lent = plan.dynamic ? lend_sched_slot(stream) : CounterSlot{};
  last_counter_slot() = lent.slot;
  const SchedArgs sa{lent.slot, schedule_l2_heads<T>(p)};
  kernel<<<plan.blocks, T::kNThreads, T::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v, tm_o, sa);
  const cudaError_t err = cudaGetLastError();
  release_counter_slot(lent, stream, err == cudaSuccess);
  return err;
}

template <typename T>
cudaError_t launch_sm90(const AttentionParams& p, cudaStream_t stream) {
  return p.varlen() ? launch_sm90_kernel<typename T::Packed>(p, stream)
                    : launch_sm90_kernel<T>(p, stream);
}

}  // namespace flashserve::kernels::cuda::sm90
