// The CUDA backend: every usable GPU (or those of --devices) gets `streams_per_device` slots (a
// stream, its events and a completion thread). A job is dispatched to the device with the fewest
// outstanding bytes that has a free slot. Its tensors are where the runtime placed them
// (runtime/tensor_placement.h: page-locked memory, or pageable when the pinned pool is full);
// H2D -> kernel -> D2H -> free run stream-ordered on the slot's stream (runtime/cuda_transfer.h
// picks the copies), the kernel configuration comes from autotune/kernel_choice.h, and the
// scheduler worker returns at once. The slot's completion thread waits for the job's last event
// (polling briefly, then blocking) and calls the job's done callback, so neither gRPC threads nor
// scheduler workers wait on the GPU -- except for jobs predicted to take under half the polling
// window, which the launching thread completes itself (a thread hand-off would cost as much).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "autotune/kernel_choice.h"
#include "flashserve/kernels/cuda_attention.h"
#include "memory/pinned_pool.h"
#include "runtime/backend.h"
#include "runtime/backend_options.h"
#include "runtime/cuda_shm_access.h"

namespace flashserve {

// CudaBackendOptions: runtime/backend_options.h.

/// Thread-safe.
class CudaBackend final : public Backend {
 public:
  /// UNAVAILABLE when no usable GPU (none visible, driver missing, compute capability < 8.0).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;

  const BackendCapabilities& capabilities() const override { return capabilities_; }
  /// Blocking wrapper of RunAsync (tools and tests).
  absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) override;
  /// Returns once the job is queued on a stream (waits for a free slot if every one is busy).
  void RunAsync(BackendJob job, JobDone done) override;
  /// Page-locked and device memory: the runtime stages pageable inputs into the pinned pool.
  bool ReadsDirectly(const TensorBytes& tensor) const override;
  bool WritesDirectly(MemoryKind kind) const override;
  /// False once any device had a sticky error: CUDA is then unusable in the whole process, so no
  /// device takes jobs any more and readiness reports false (the orchestrator replaces it).
  bool healthy() const override { return healthy_.load(); }
  bool DevicePoolBytes(int device, int64_t* used, int64_t* reserved) const override;
  bool PinnedPoolBytes(int64_t* used, int64_t* reserved) const override;
  PinnedPool* staging_pool() override { return pinned_.get(); }
  ShmDeviceAccess* shm_device_access() override { return shm_access_.get(); }
  bool can_launch_now() override;
  /// Device memory of the first GPU (runtime/cuda_kv_store.h).
  absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CreateKvStore(int64_t bytes,
                                                                  int launches_in_flight) override;
  /// Scheduler workers to use: one per slot (a worker only stages and launches).
  int recommended_concurrency() const;

 private:
  struct Job;
  struct Slot;
  struct Device;
  CudaBackend() = default;
  // The least loaded device's free slot, waiting for one if all are busy; nullptr once a device
  // has faulted.
  Slot* AcquireSlot(int64_t device_bytes);
  void ReleaseSlot(Slot* slot, int64_t device_bytes);
  void CompletionLoop(Slot* slot);
  void Complete(Slot* slot, std::unique_ptr<Job> job);
  // INTERNAL for `e`; marks the backend unhealthy when `e` is sticky.
  absl::Status DeviceError(Device* device, cudaError_t e, const char* what);
  // Reports not live and not ready from now on (logged once): the process must be replaced.
  void MarkUnhealthy(std::string_view why);
  // UNAVAILABLE for a request after the fault, naming it (MarkUnhealthy's first `why`).
  absl::Status NotReady() const;

  // A stream with its timing events (and its CopyPipeline when pipelining is on), on the current
  // device.
  static absl::StatusOr<std::unique_ptr<Slot>> MakeSlot(Device* device,
                                                        const CudaBackendOptions& options);
  // Device `index` with its slots and memory pool settings; a device below sm_80 is skipped
  // (warned, OK).
  absl::Status AddDevice(int index, const CudaBackendOptions& options);
  absl::Status StartKernelChoice(const CudaBackendOptions& options);
  // Allocates the job's device buffer on the slot's stream and points `params` at it;
  // INVALID_ARGUMENT when the kernels cannot run the problem (nothing allocated then).
  absl::Status PrepareDeviceBuffer(Slot* slot, const Job& job, char** base,
                                   kernels::AttentionParams* params);
  // Queues H2D, the kernel, D2H, the timing events and the free on the slot's stream.
  void QueueWork(Slot* slot, Job* job, char* base, const kernels::AttentionParams& params);
  // The head chunks of the job (1: not pipelined).
  int PipelineChunksFor(Slot* slot, const Job& job, const char* base,
                        const kernels::AttentionParams& params);
  // Between QueueWork's first and last events: H2D, kernel and D2H one after another on the
  // slot's stream (events[1] after H2D, events[2] after the kernel), or, for chunks > 1, spread
  // over the slot's CopyPipeline (events[1] after the last input, events[2] after the last kernel).
  void QueueInOrder(Slot* slot, Job* job, char* base, const kernels::AttentionParams& params);
  void QueuePipelined(Slot* slot, Job* job, char* base, const kernels::AttentionParams& params);

  BackendCapabilities capabilities_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::unique_ptr<KernelChooser> chooser_;  // tuned configurations for the first device's model
  std::unique_ptr<PinnedPool> pinned_;  // null: pinned staging disabled
  std::unique_ptr<CudaShmAccess> shm_access_;  // clients' shared-memory regions
  int64_t max_device_bytes_per_request_ = 0;
  int completion_spin_us_ = 0;
  int copy_pipeline_chunks_ = 1;
  std::mutex mu_;                    // guards every Device's free_slots and load counters
  uint64_t choices_ = 0;             // guarded by mu_: slots handed out so far
  std::condition_variable slot_cv_;  // a slot was released
  std::atomic<bool> healthy_{true};
  mutable std::mutex fault_mu_;
  std::string fault_;  // guarded by fault_mu_: the first sticky fault, set once
};

}  // namespace flashserve
