// The CPU backend: tiled online-softmax attention on a thread pool (kernels/cpu).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "flashserve/kernels/cpu_attention.h"
#include "runtime/backend.h"
#include "runtime/backend_options.h"
#include "memory/pinned_pool.h"

namespace flashserve {

// CpuBackendOptions: runtime/backend_options.h.

/// Thread-safe.
class CpuBackend final : public Backend {
 public:
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const CpuBackendOptions& options);

  const BackendCapabilities& capabilities() const override { return capabilities_; }
  absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) override;
  int num_threads() const { return pool_->num_threads(); }
  PinnedPool* staging_pool() override { return buffers_.get(); }

 private:
  explicit CpuBackend(int num_threads);
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<PinnedPool> buffers_;  // heap memory; null when disabled
  BackendCapabilities capabilities_;
};

}  // namespace flashserve
