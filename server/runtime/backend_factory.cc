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
    // A refused option, or a stop asked for during startup tuning: not "unavailable".
    if (cuda.status().code() == absl::StatusCode::kInvalidArgument ||
        cuda.status().code() == absl::StatusCode::kCancelled) {
      return cuda.status();
    }
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
