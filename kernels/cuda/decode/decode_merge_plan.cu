// Host side of the split kernel's in-place merge (decode_merge.h): whether a launch takes it,
// and the group counters it counts on.
//
// Counters live in a device global (zero at load), in kSlots slots of kSlotWords groups. Every
// completed launch leaves its counters at zero, so a slot may pass to another launch once the
// previous one has finished, or at once when both are queued on the same stream: the split
// kernel waits for the grid before it (griddepcontrol.wait) before touching a counter. A slot
// therefore stays with the stream that used it last (by cudaStreamGetId: unique for the
// context's life, so a handle reused after cudaStreamDestroy is another stream, and per-thread
// default streams are told apart), and moves to another stream only once the event recorded
// after its last launch has completed. With no slot free (more than kSlots streams busy at once)
// and during stream capture, the launch takes the combine kernel instead.
#include <cuda.h>  // CUevent / CUresult (types only: nothing links libcuda)

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>

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
constexpr int kMaxDevices = 64;

__device__ unsigned g_merge_counters[kSlots * kSlotWords];  // 1 MiB per device, zero at load

struct Slot {
  cudaEvent_t done = nullptr;        // recorded after the slot's last launch
  unsigned long long stream_id = 0;  // cudaStreamGetId of that launch's stream
  bool used = false;                 // a launch was recorded (done and stream_id are valid)
  bool reserved = false;             // between plan_in_kernel_merge and finish_in_kernel_merge
  bool broken = false;               // its completion cannot be known (event failure): never reused
};

struct DeviceSlots {
  std::mutex mu;
  unsigned* base = nullptr;
  std::array<Slot, kSlots> slots;
  int next = 0;
};

std::array<DeviceSlots, kMaxDevices>& all_devices() {
  static std::array<DeviceSlots, kMaxDevices> devices;
  return devices;
}

/// Whether the launch recorded on `done` has completed: cuEventQuery, looked up through the
/// runtime (no libcuda link). Not cudaEventQuery: its cudaErrorNotReady would become the
/// caller's last runtime error (cudaGetLastError) after a run_decode that succeeded.
bool completed(cudaEvent_t done) {
  using QueryFn = CUresult (*)(CUevent);
  static const QueryFn query = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuEventQuery", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return QueryFn{nullptr};
    return reinterpret_cast<QueryFn>(fn);
  }();
  return query != nullptr && query(reinterpret_cast<CUevent>(done)) == CUDA_SUCCESS;
}

/// A slot for a launch on the stream with id stream_id (d.mu held), or -1.
int take_slot(DeviceSlots& d, unsigned long long stream_id) {
  for (int i = 0; i < kSlots; ++i) {
    const Slot& s = d.slots[i];
    if (s.used && !s.reserved && !s.broken && s.stream_id == stream_id) return i;
  }
  for (int k = 0; k < kSlots; ++k) {
    const int i = (d.next + k) % kSlots;
    Slot& s = d.slots[i];
    if (s.reserved || s.broken) continue;
    if (s.used && !completed(s.done)) continue;  // still queued or running
    if (s.done == nullptr &&
        cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming) != cudaSuccess) {
      s.done = nullptr;
      return -1;
    }
    d.next = (i + 1) % kSlots;
    return i;
  }
  return -1;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &status) != cudaSuccess ||
         status != cudaStreamCaptureStatusNone;
}

}  // namespace

int& fused_merge_override() {
  static int value = -1;
  return value;
}

int& last_merge() {
  thread_local int value = 0;
  return value;
}

int& last_merge_slot() {
  thread_local int value = -1;
  return value;
}

MergeSlot plan_in_kernel_merge(const DecodeParams& p, const DecodeKernel& k, int num_splits,
                               int row_blocks, cudaStream_t stream) {
  last_merge_slot() = -1;
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
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return {};
  unsigned long long stream_id = 0;
  if (capturing(stream) || cudaStreamGetId(stream, &stream_id) != cudaSuccess) return {};
  DeviceSlots& d = all_devices()[device];
  std::lock_guard<std::mutex> lock(d.mu);
  if (d.base == nullptr) {
    void* symbol = nullptr;
    if (cudaGetSymbolAddress(&symbol, g_merge_counters) != cudaSuccess) return {};
    d.base = static_cast<unsigned*>(symbol);
  }
  const int slot = take_slot(d, stream_id);
  last_merge_slot() = slot;
  if (slot < 0) return {};
  d.slots[slot].reserved = true;
  return {d.base + int64_t{slot} * kSlotWords, device, slot, stream_id};
}

void finish_in_kernel_merge(const MergeSlot& m, cudaStream_t stream, bool launched) {
  if (m.counters == nullptr) return;
  DeviceSlots& d = all_devices()[m.device];
  std::lock_guard<std::mutex> lock(d.mu);
  Slot& s = d.slots[m.slot];
  s.reserved = false;
  if (!launched) return;  // nothing ran: the slot's state is what it was
  if (cudaEventRecord(s.done, stream) != cudaSuccess) {
    s.broken = true;  // when this launch ends cannot be known
    return;
  }
  s.stream_id = m.stream_id;
  s.used = true;
}

}  // namespace flashserve::kernels::cuda::decode
