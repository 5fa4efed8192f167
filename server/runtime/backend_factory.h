// Picks and creates the backend named by --backend (auto, cuda or cpu).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "autotune/background_tuner.h"
#include "autotune/tune_grid.h"
#include "runtime/backend.h"

namespace flashserve {

struct BackendOptions {
  std::string kind = "auto";     // auto: cuda when a usable GPU exists, else cpu
  int cpu_threads = 0;           // CPU backend compute threads; 0: all cores
  std::vector<int> devices;      // CUDA devices to use; empty: all visible
  // CUDA backend: see CudaBackendOptions.
  int streams_per_device = 4;
  int completion_spin_us = 200;
  int64_t device_pool_release_threshold_bytes = int64_t{4} << 30;
  int64_t pinned_pool_bytes = int64_t{2} << 30;
  int64_t receive_arena_bytes = 0;
  int64_t max_device_bytes_per_request = 0;
  std::string autotune = "off";  // off | background | startup (CUDA only)
  std::string tune_cache_path;
  TuneGrid startup_grid;
  BackgroundTuner::EventFn on_autotune_event;
};

struct CreatedBackend {
  std::unique_ptr<Backend> backend;
  std::string reason;  // why this backend was chosen, for the startup log
  int scheduler_workers = 1;
};

absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options);

/// Whether this binary was built with the CUDA backend.
bool CudaBackendCompiledIn();

}  // namespace flashserve
