// Host bookkeeping of the device counter pools (counter_slots.h): per (pool, device), which
// stream used each slot last and an event marking when that launch ends.
#include "counter_slots.h"

#include <cuda.h>  // CUevent / CUresult (types only: nothing links libcuda)

#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace flashserve::kernels::cuda {
namespace {

struct Slot {
  cudaEvent_t done = nullptr;        // recorded after the slot's last launch
  unsigned long long stream_id = 0;  // cudaStreamGetId of that launch's stream
  bool used = false;                 // a launch was recorded (done and stream_id are valid)
  bool reserved = false;             // between acquire and release
  bool broken = false;               // its completion cannot be known (event failure): never lent
};

struct Pool {
  std::vector<Slot> slots;
  int next = 0;  // where the search for a free slot starts (spreads slots over streams)
};

struct Pools {
  std::mutex mu;
  std::map<std::pair<const void*, int>, Pool> by_key;  // (device address, device)
};

Pools& pools() {
  static Pools* all = new Pools;  // never destroyed: launches may run during static teardown
  return *all;
}

enum class LaunchState { kRunning, kEnded, kContextGone };

/// Where the launch recorded on `done` stands: cuEventQuery, looked up through the runtime (no
/// libcuda link). Not cudaEventQuery: its NotReady is not left as the last error (CUDA 13,
/// tests/gpu/cuda_runtime_facts_test.cc), but the answers that matter here, for an event whose
/// context is gone, may be (not tested), and this runs inside the caller's decode launch. Any
/// other error: the event's context is gone (cudaDeviceReset) or broken, and no launch of it
/// runs any more.
LaunchState launch_state(cudaEvent_t done) {
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
  if (query == nullptr) return LaunchState::kRunning;  // cannot tell: never lend it elsewhere
  const CUresult r = query(reinterpret_cast<CUevent>(done));
  return r == CUDA_SUCCESS           ? LaunchState::kEnded
         : r == CUDA_ERROR_NOT_READY ? LaunchState::kRunning
                                     : LaunchState::kContextGone;
}

/// A slot of `pool` for a launch on the stream with id stream_id (the pools' mutex held), or -1.
int take_slot(Pool& pool, unsigned long long stream_id) {
  const int n = int(pool.slots.size());
  for (int i = 0; i < n; ++i) {
    const Slot& s = pool.slots[i];
    if (s.used && !s.reserved && !s.broken && s.stream_id == stream_id) return i;
  }
  for (int k = 0; k < n; ++k) {
    const int i = (pool.next + k) % n;
    Slot& s = pool.slots[i];
    if (s.reserved || s.broken) continue;
    if (s.used) {
      const LaunchState state = launch_state(s.done);
      if (state == LaunchState::kRunning) continue;        // still queued or running
      if (state == LaunchState::kContextGone) s = Slot{};  // its event went with its context
    }
    if (s.done == nullptr &&
        cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming) != cudaSuccess) {
      s.done = nullptr;
      return -1;
    }
    pool.next = (i + 1) % n;
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

CounterSlot acquire_counter_slot(const void* pool, int num_slots, cudaStream_t stream) {
  CounterSlot s;
  int device = 0;
  unsigned long long stream_id = 0;
  if (pool == nullptr || num_slots < 1 || cudaGetDevice(&device) != cudaSuccess ||
      capturing(stream) || cudaStreamGetId(stream, &stream_id) != cudaSuccess)
    return s;
  Pools& all = pools();
  std::lock_guard<std::mutex> lock(all.mu);
  Pool& p = all.by_key[{pool, device}];
  if (p.slots.empty()) p.slots.resize(size_t(num_slots));
  const int slot = take_slot(p, stream_id);
  if (slot < 0) return s;
  p.slots[slot].reserved = true;
  return {pool, device, slot, stream_id};
}

int& last_counter_slot() {
  thread_local int slot = -1;
  return slot;
}

void release_counter_slot(const CounterSlot& s, cudaStream_t stream, bool launched) {
  if (s.slot < 0) return;
  Pools& all = pools();
  std::lock_guard<std::mutex> lock(all.mu);
  Slot& slot = all.by_key.at({s.pool, s.device}).slots[size_t(s.slot)];
  slot.reserved = false;
  if (!launched) return;  // nothing ran: the slot's state is what it was
  if (cudaEventRecord(slot.done, stream) != cudaSuccess) {
    slot.broken = true;  // when this launch ends cannot be known
    return;
  }
  slot.stream_id = s.stream_id;
  slot.used = true;
}

}  // namespace flashserve::kernels::cuda
