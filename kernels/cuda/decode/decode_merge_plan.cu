// Host side of the split kernel's in-place merge (decode_merge.h): whether a launch takes it,
// and the group counters it counts on.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "decode_merge.h"

namespace flashserve::kernels::cuda::decode {
namespace {

// Default: merge in the split kernel where the merge is small (see plan_in_kernel_merge).
constexpr bool kInKernelMergeByDefault = true;
// The most partial bytes (splits x rows x head_dim x 4) one block merges in place. H200, session
// 26 (K1, K2: in-kernel vs the combine kernel, same build, interleaved): 1-8 KB ran 1.01-1.04x
// faster (d64 MHA B1-B2, d128 GQA B8 Sk8k: the combine's launch and grid drain saved); 16-64 KB
// ran 0.91-0.99x (d128 GQA B1 with 8-32 splits, Sq 4 with 16 rows): one block merging that much
// after its own key tiles is slower than the combine kernel's pass.
constexpr int64_t kMaxMergeBytes = 8192;
// Counters come in slots of kSlotWords, handed to launches round-robin. Every completed launch
// leaves its counters at zero, so a slot is safe to reuse once its previous launch has finished:
// in stream order always, and across streams unless kSlots launches are in flight at once.
constexpr int kSlots = 64;
constexpr int kSlotWords = 4096;  // groups (sequences x KV heads x row blocks) per launch
constexpr int kMaxDevices = 64;

// Zero at module load (device globals are zero-initialized); 1 MiB per device.
__device__ unsigned g_merge_counters[kSlots * kSlotWords];

/// g_merge_counters on the current device (looked up once per device), or null.
unsigned* device_counters() {
  static std::array<std::atomic<unsigned*>, kMaxDevices> bases{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return nullptr;
  unsigned* base = bases[device].load(std::memory_order_acquire);
  if (base == nullptr) {
    void* symbol = nullptr;
    if (cudaGetSymbolAddress(&symbol, g_merge_counters) != cudaSuccess) return nullptr;
    base = static_cast<unsigned*>(symbol);
    bases[device].store(base, std::memory_order_release);
  }
  return base;
}

}  // namespace

int& fused_merge_override() {
  static int value = -1;
  return value;
}

int& last_merge() {
  static int value = 0;
  return value;
}

unsigned* plan_in_kernel_merge(const DecodeParams& p, const DecodeKernel& k, int num_splits,
                               int row_blocks) {
  const int mode = fused_merge_override();
  if (num_splits <= 1 || mode == 0 || (mode < 0 && !kInKernelMergeByDefault)) return nullptr;
  const int64_t groups = int64_t{p.batch} * p.heads_kv * row_blocks;
  if (groups > kSlotWords) return nullptr;
  // merge_partials stages every split's partial rows of the block's rows (and their weights)
  // in the kernel's shared memory.
  const int64_t rows = std::min<int64_t>(k.block_m, int64_t{p.heads_q / p.heads_kv} * p.seqlen_q);
  const int64_t partial_bytes = int64_t{num_splits} * rows * p.head_dim * 4;
  const int64_t weight_bytes = (int64_t{num_splits} * rows * 4 + 15) / 16 * 16;
  if (partial_bytes > kMaxMergeBytes || partial_bytes + weight_bytes > int64_t(k.smem_bytes))
    return nullptr;
  unsigned* base = device_counters();
  if (base == nullptr) return nullptr;
  static std::atomic<unsigned> next_slot{0};
  return base + (next_slot.fetch_add(1, std::memory_order_relaxed) % kSlots) * kSlotWords;
}

}  // namespace flashserve::kernels::cuda::decode
