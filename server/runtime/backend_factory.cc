#include "runtime/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "runtime/cpu_backend.h"
#ifdef FLASHSERVE_WITH_CUDA
#include "runtime/cuda_backend.h"
#endif

namespace flashserve {

bool CudaBackendCompiledIn() {
#ifdef FLASHSERVE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options) {
  if (options.kind != "auto" && options.kind != "cuda" && options.kind != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cuda or cpu, got \"", options.kind, "\""));
  }
  CreatedBackend created;
  std::string cuda_problem = "this binary was built without CUDA";
#ifdef FLASHSERVE_WITH_CUDA
  if (options.kind != "cpu") {
    CudaBackendOptions cuda_options;
    cuda_options.devices = options.devices;
    cuda_options.streams_per_device = options.streams_per_device;
    cuda_options.completion_spin_us = options.completion_spin_us;
    cuda_options.device_pool_release_threshold_bytes =
        uint64_t(options.device_pool_release_threshold_bytes);
    cuda_options.pinned_pool_bytes = options.pinned_pool_bytes;
    cuda_options.receive_arena_bytes = options.receive_arena_bytes;
    cuda_options.max_device_bytes_per_request = options.max_device_bytes_per_request;
    cuda_options.autotune = options.autotune;
    cuda_options.tune_cache_path = options.tune_cache_path;
    cuda_options.startup_grid = options.startup_grid;
    cuda_options.on_autotune_event = options.on_autotune_event;
    absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create(cuda_options);
    if (cuda.ok()) {
      created.scheduler_workers = (*cuda)->recommended_concurrency();
      created.backend = std::move(*cuda);
      created.reason = options.kind == "auto" ? "auto: a usable CUDA GPU was found" : "requested";
      return created;
    }
    cuda_problem = std::string(cuda.status().message());
    if (cuda.status().code() == absl::StatusCode::kInvalidArgument) return cuda.status();
  }
#endif
  if (options.kind == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("--backend=cuda but the CUDA backend is unavailable: ", cuda_problem));
  }
  CpuBackendOptions cpu_options;
  cpu_options.num_threads = options.cpu_threads;
  cpu_options.buffer_pool_bytes = options.pinned_pool_bytes;
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(cpu_options);
  if (!cpu.ok()) return cpu.status();
  created.backend = std::move(*cpu);
  created.reason = options.kind == "auto" ? absl::StrCat("auto: no usable GPU (", cuda_problem, ")")
                                          : "requested";
  created.scheduler_workers = 1;  // one job at a time, each spread over all CPU threads
  return created;
}

}  // namespace flashserve
