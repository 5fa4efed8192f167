// The CPU backend: tiled online-softmax attention on a thread pool (kernels/cpu).
#pragma once

#include <atomic>

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
  /// Stops early (DEADLINE_EXCEEDED or CANCELLED; partial output) once job.deadline passes or
  /// job.cancelled() holds: its threads look between key tiles, so they are free for the next
  /// job within a millisecond or so.
  absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) override;
  int num_threads() const { return pool_->num_threads(); }
  PinnedPool* staging_pool() override { return buffers_.get(); }
  /// Host memory (runtime/cpu_kv_store.h), attention on this backend's threads.
  absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CreateKvStore(int64_t bytes,
                                                                  int launches_in_flight) override;
  /// False once a job asked for a fault (--enable_fault_injection): the CPU twin of a sticky
  /// CUDA error, so the fault -> not live -> drain -> exit 3 path is tested without a GPU.
  bool healthy() const override { return healthy_.load(); }

 private:
  explicit CpuBackend(int num_threads);
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<PinnedPool> buffers_;  // heap memory; null when disabled
  BackendCapabilities capabilities_;
  std::atomic<bool> healthy_{true};
};

}  // namespace flashserve
