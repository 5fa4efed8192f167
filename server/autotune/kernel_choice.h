// Which kernel configuration serves a problem: the tuning cache's winner for its problem class
// when there is one for this GPU model and kernel build, else the kernels' heuristic default.
// Owns the tuning cache, the background tuner and its low-priority stream. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "autotune/background_tuner.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"
#include "autotune/tune_grid.h"
#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/decode_attention.h"
#include "flashserve/kernels/kernel_config.h"

namespace flashserve {

struct KernelChoiceOptions {
  // "off": the cache read-only if given, else the heuristic; "background": unseen classes are
  // tuned off the request path; "startup": startup_grid is tuned in Create, then "background".
  std::string autotune = "off";
  std::string tune_cache_path;  // "": tuning results stay in memory
  TuneGrid startup_grid;
  int max_classes = BackgroundTuner::Options{}.max_classes;  // BackgroundTuner::Options
  BackgroundTuner::EventFn on_event;  // "hit", "miss", "tuned", "failed"; may be empty
  // Polled during startup tuning: true ends Create with CANCELLED (a signal must not wait for the
  // whole grid: minutes). May be empty.
  std::function<bool()> stop_requested;
};

/// Thread-safe.
class KernelChooser {
 public:
  /// Tuning runs on device `device_index` (the first device served). INVALID_ARGUMENT for an
  /// unknown mode; UNAVAILABLE when the device cannot be described or a stream made.
  static absl::StatusOr<std::unique_ptr<KernelChooser>> Create(const KernelChoiceOptions& options,
                                                               int device_index);
  ~KernelChooser();

  /// Whether the cache applies to `device`: the cache belongs to one model with one SM count.
  bool Covers(const DeviceIdentity& device) const;
  /// The configuration for `params` on a device with `sm_count` SMs; `covered`: Covers() of it.
  /// The cached one only where run() accepts it for `params` (kernels::cuda::runnable), else
  /// the heuristic's.
  kernels::cuda::KernelConfig Choose(const kernels::AttentionParams& params, int sm_count,
                                     bool covered) const;
  /// Key-axis splits for the decode launch p (kernels::cuda::DecodeParams::num_splits) on a
  /// device with sm_count SMs: the count pinned for p's DecodeClass when the cache has one and
  /// `covered`, else (also for "splits=plan") kernels::cuda::decode_num_splits(p, sm_count). A miss
  /// queues the class for background tuning (modes background and startup); the lookup never waits
  /// for it.
  int DecodeSplits(const kernels::cuda::DecodeParams& p, int sm_count, bool covered) const;

 private:
  KernelChooser() = default;
  absl::Status StartTuner(const KernelChoiceOptions& options, int device_index);

  DeviceIdentity identity_;
  std::unique_ptr<TuneCache> cache_;         // null: no tuning, no cache
  std::unique_ptr<BackgroundTuner> tuner_;   // null: cache read-only
  cudaStream_t stream_ = nullptr;            // the tuner's, lowest priority
  int device_index_ = 0;                     // where the tuner runs
};

/// DecodeSplits through `chooser`, or the heuristic when there is none (null).
int DecodeSplitsFor(const KernelChooser* chooser, const kernels::cuda::DecodeParams& p,
                    int sm_count, bool covered);

}  // namespace flashserve
