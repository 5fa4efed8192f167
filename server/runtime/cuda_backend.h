// The CUDA backend (first version): per request, stream-ordered device buffers, H2D -> kernel ->
// D2H on one of a few streams per device, timed with events. The pinned staging pools, async
// completion and multi-device balancing of issue 9 build on this.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "runtime/backend.h"

namespace flashserve {

struct CudaBackendOptions {
  std::vector<int> devices;    // empty: every visible device
  int streams_per_device = 2;  // jobs in flight per device
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
  int recommended_concurrency() const;

 private:
  struct Slot;
  struct Device;
  CudaBackend() = default;
  Slot* Acquire(Device** device);
  void Release(Device* device, Slot* slot);

  BackendCapabilities capabilities_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex mu_;
  std::atomic<bool> healthy_{true};
};

}  // namespace flashserve
