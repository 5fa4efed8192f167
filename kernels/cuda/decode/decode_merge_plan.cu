// Host side of the split kernel's in-place merge (decode_merge.h): whether a launch takes it,
// and the group counters it counts on.
//
// Counters live in a device global (zero at load), in kSlots slots of kSlotWords groups, lent
// per launch by counter_slots.h (a slot stays with its stream and passes to another only once
// its last launch has ended). With no slot free (more than kSlots streams busy at once) and
// during stream capture, the launch takes the combine kernel instead.
#include <algorithm>
#include <cstdint>

#include "../counter_slots.h"
#include "decode_merge_plan.h"

namespace flashserve::kernels::cuda::decode {
namespace {

// Default: merge in the split kernel where the merge is small (see plan_in_kernel_merge).
constexpr bool kInKernelMergeByDefault = true;
// The most partial bytes (splits x rows x head_dim x 4) one block merges in place. H200, session
// 26 (K1, K2: in-kernel vs the combine kernel, same build, interleaved): 1-8 KB ran 1.01-1.04x
// faster (d64 MHA B1-B2, d128 GQA B8 Sk8k: the combine's launch and grid drain saved); 16-64 KB
// ran 0.91-0.99x (d128 GQA B1 with 8-32 splits, Sq 4 with 16 rows). Most of that loss was one
// or two runtime divisions per 16-byte copy in the merge loops; without them (session 27, K1,
// knob 2 vs the combine kernel) 16-32 KB merges run 0.98-1.016x: no clear gain, so the limit stays.
constexpr int64_t kMaxMergeBytes = 8192;
constexpr int kSlots = 64;
constexpr int kSlotWords = 4096;  // groups (sequences x KV heads x row blocks) per launch

__device__ unsigned g_merge_counters[kSlots * kSlotWords];  // 1 MiB per device, zero at load

}  // namespace

MergeSlot plan_in_kernel_merge(const DecodeParams& p, const DecodeKernel& k, int num_splits,
                               int row_blocks, cudaStream_t stream) {
  last_counter_slot() = -1;
  const int mode = fused_merge_override();
  if (num_splits <= 1 || mode == 0 || (mode < 0 && !kInKernelMergeByDefault)) return {};
  if (int64_t{p.batch} * p.heads_kv * row_blocks > kSlotWords) return {};
  // merge_partials stages every split's partial rows of the block's rows (and their weights)
  // in the kernel's shared memory.
  const int64_t rows = std::min<int64_t>(k.block_m, int64_t{p.heads_q / p.heads_kv} * p.seqlen_q);
  const int64_t partial_bytes = int64_t{num_splits} * rows * p.head_dim * 4;
  const int64_t header_bytes = int64_t(merge_header_bytes(k.block_m, num_splits, int(rows)));
  if ((mode != 2 && partial_bytes > kMaxMergeBytes) ||
      partial_bytes + header_bytes > int64_t(k.smem_bytes))
    return {};
  // Looked up per launch, not cached: after a cudaDeviceReset the module (and its counters)
  // may load elsewhere.
  void* counters = nullptr;
  if (cudaGetSymbolAddress(&counters, g_merge_counters) != cudaSuccess) return {};
  MergeSlot m;
  m.lent = acquire_counter_slot(counters, kSlots, stream);
  last_counter_slot() = m.lent.slot;
  if (m.lent.slot < 0) return {};
  m.counters = static_cast<unsigned*>(counters) + int64_t{m.lent.slot} * kSlotWords;
  return m;
}

void finish_in_kernel_merge(const MergeSlot& m, cudaStream_t stream, bool launched) {
  release_counter_slot(m.lent, stream, launched);
}

}  // namespace flashserve::kernels::cuda::decode
