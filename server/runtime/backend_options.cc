// The backend options' range checks (runtime/backend_options.h): no backend code, so tools and
// fuzz targets that build a backend from options link them alone.
#include "runtime/backend_options.h"

#include "absl/strings/str_cat.h"

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
  if (copy_pipeline_chunks < 1 || copy_pipeline_chunks > 8) {
    return OutOfRange("copy_pipeline_chunks", copy_pipeline_chunks, 1, 8);
  }
  if (device_pool_release_threshold_bytes < 0) {
    return absl::InvalidArgumentError("--device_pool_release_threshold_bytes must be >= 0");
  }
  if (pinned_pool_bytes < 0) return absl::InvalidArgumentError("--pinned_pool_bytes must be >= 0");
  if (max_device_bytes_per_request < 0) {
    return absl::InvalidArgumentError("--max_device_bytes_per_request must be >= 0");
  }
  if (tune_max_classes < 0 || tune_max_classes > 1000000) {
    return OutOfRange("tune_max_classes", tune_max_classes, 0, 1000000);
  }
  if (autotune != "off" && autotune != "background" && autotune != "startup") {
    return absl::InvalidArgumentError(
        absl::StrCat("--autotune must be off, background or startup, got \"", autotune, "\""));
  }
  return absl::OkStatus();
}

absl::Status CpuBackendOptions::Check() const {
  // Thousands of threads failed to start and ended the process (std::system_error).
  if (num_threads < 0 || num_threads > kMaxThreads) {
    return OutOfRange("worker_threads", num_threads, 0, kMaxThreads);
  }
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

}  // namespace flashserve
