#include "runtime/backend_factory.h"

#include "absl/strings/str_cat.h"
#include "runtime/cpu_backend.h"
#ifdef FLASHSERVE_WITH_CUDA
#include "runtime/cuda_backend.h"
#endif

namespace flashserve {
namespace {

absl::Status OutOfRange(absl::string_view flag, int64_t value, int64_t low, int64_t high) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in [", low, ", ", high, "], got ", value));
}

}  // namespace

absl::Status CudaBackendOptions::Check() const {
  for (int device : devices) {
    if (device < 0)
      return absl::InvalidArgumentError(absl::StrCat("--devices: bad index ", device));
  }
  if (streams_per_device < 1 || streams_per_device > 64) {
    return OutOfRange("streams_per_device", streams_per_device, 1, 64);
  }
  if (completion_spin_us < 0 || completion_spin_us > 1000000) {
    return OutOfRange("completion_spin_us", completion_spin_us, 0, 1000000);
  }
  if (device_pool_release_threshold_bytes < 0) {
    return absl::InvalidArgumentError("--device_pool_release_threshold_bytes must be >= 0");
  }
  if (pinned_pool_bytes < 0) return absl::InvalidArgumentError("--pinned_pool_bytes must be >= 0");
  if (max_device_bytes_per_request < 0) {
    return absl::InvalidArgumentError("--max_device_bytes_per_request must be >= 0");
  }
  if (autotune != "off" && autotune != "background" && autotune != "startup") {
    return absl::InvalidArgumentError(
        absl::StrCat("--autotune must be off, background or startup, got \"", autotune, "\""));
  }
  return absl::OkStatus();
}

absl::Status CpuBackendOptions::Check() const {
  if (num_threads < 0) return absl::InvalidArgumentError("--worker_threads must be >= 0");
  if (buffer_pool_bytes < 0) return absl::InvalidArgumentError("--pinned_pool_bytes must be >= 0");
  return absl::OkStatus();
}

absl::Status BackendOptions::Check() const {
  if (kind != "auto" && kind != "cuda" && kind != "cpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be auto, cuda or cpu, got \"", kind, "\""));
  }
  if (absl::Status s = cuda.Check(); !s.ok()) return s;
  return cpu.Check();
}

bool CudaBackendCompiledIn() {
#ifdef FLASHSERVE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options) {
  if (absl::Status s = options.Check(); !s.ok()) return s;
  CreatedBackend created;
  std::string cuda_problem = "this binary was built without CUDA";
#ifdef FLASHSERVE_WITH_CUDA
  if (options.kind != "cpu") {
    absl::StatusOr<std::unique_ptr<CudaBackend>> cuda = CudaBackend::Create(options.cuda);
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
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create(options.cpu);
  if (!cpu.ok()) return cpu.status();
  created.backend = std::move(*cpu);
  created.reason = options.kind == "auto" ? absl::StrCat("auto: no usable GPU (", cuda_problem, ")")
                                          : "requested";
  created.scheduler_workers = 1;  // one job at a time, each spread over all CPU threads
  return created;
}

}  // namespace flashserve
