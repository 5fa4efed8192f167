// The CUDA backend (first version): per request, stream-ordered device buffers, H2D -> kernel ->
// D2H on one of a few streams per device, timed with events. The pinned staging pools, async
// completion and multi-device balancing of issue 9 build on this.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "autotune/background_tuner.h"
#include "autotune/tune_cache.h"
#include "autotune/tune_grid.h"
#include "flashserve/kernels/cuda_attention.h"
#include "runtime/backend.h"

namespace flashserve {

struct CudaBackendOptions {
  std::vector<int> devices;    // empty: every visible device
  int streams_per_device = 2;  // jobs in flight per device
  // Autotuning (issue 4): "off" uses the cache read-only if given, else the heuristic default;
  // "background" tunes unseen classes off the request path; "startup" tunes startup_grid in
  // Create, before the server reports ready, then continues as "background".
  std::string autotune = "off";
  std::string tune_cache_path;  // "" keeps tuning results in memory only
  TuneGrid startup_grid;
  BackgroundTuner::EventFn on_autotune_event;  // "hit", "miss", "tuned", "failed"; may be empty
};

/// Thread-safe.
class CudaBackend final : public Backend {
 public:
  /// UNAVAILABLE when no usable GPU (none visible, driver missing, compute capability < 8.0).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);
  ~CudaBackend() override;

  const BackendCapabilities& capabilities() const override { return capabilities_; }
  absl::Status Run(const AttentionProblem& problem, const JobOutput& output, PhaseTiming* timing,
                   std::string* kernel) override;
  bool healthy() const override { return healthy_.load(); }
  bool DevicePoolBytes(int device, int64_t* used, int64_t* reserved) const override;
  int recommended_concurrency() const;

 private:
  struct Slot;
  struct Device;
  CudaBackend() = default;
  Slot* Acquire(Device** device);
  void Release(Device* device, Slot* slot);

  absl::Status StartAutotune(const CudaBackendOptions& options);
  kernels::cuda::KernelConfig ChooseConfig(const kernels::AttentionParams& params,
                                           const Device& device);

  BackendCapabilities capabilities_;
  std::vector<std::unique_ptr<Device>> devices_;
  // Tuning applies to devices identical to the first one (the cache belongs to one model).
  DeviceIdentity tuned_identity_;
  std::unique_ptr<TuneCache> tune_cache_;
  std::unique_ptr<BackgroundTuner> tuner_;
  cudaStream_t tune_stream_ = nullptr;
  std::mutex mu_;
  std::atomic<bool> healthy_{true};
};

}  // namespace flashserve
