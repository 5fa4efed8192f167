#include "autotune/cuda_tuning.h"

#include "absl/strings/str_cat.h"
#include "common/kernel_build_id.h"

namespace flashserve {

absl::StatusOr<CudaDeviceFacts> DescribeCudaDevice(int device) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(e)));
  }
  CudaDeviceFacts facts;
  facts.identity = {prop.name, prop.major, prop.minor};
  facts.sm_count = prop.multiProcessorCount;
  return facts;
}

TuneCacheHeader CacheHeaderFor(const DeviceIdentity& device) {
  TuneCacheHeader header;
  header.device_name = device.name;
  header.cc_major = device.cc_major;
  header.cc_minor = device.cc_minor;
  cudaDriverGetVersion(&header.driver_version);
  cudaRuntimeGetVersion(&header.runtime_version);
  header.build_id = kKernelBuildId;
  return header;
}

absl::StatusOr<TuneRecord> TuneProblemClass(const ProblemClass& c, int sm_count,
                                            cudaStream_t stream,
                                            const kernels::cuda::TuneOptions& options) {
  const kernels::AttentionParams problem = c.representative(sm_count);
  kernels::cuda::TuneReport report;
  const cudaError_t e = kernels::cuda::tune(problem, stream, options, &report);
  if (e != cudaSuccess) {
    cudaGetLastError();
    const absl::Status status =
        absl::Status(e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                                    : absl::StatusCode::kInternal,
                     absl::StrCat("tuning ", c.key(), ": ", cudaGetErrorString(e)));
    return status;
  }
  if (report.best < 0) {
    return absl::InternalError(absl::StrCat("tuning ", c.key(), ": no candidate ran correctly"));
  }
  TuneRecord record;
  const kernels::cuda::CandidateTiming& best = report.timings[size_t(report.best)];
  record.config = best.config.name();
  record.tflops = best.tflops;
  if (report.runner_up >= 0) {
    record.runner_up = report.timings[size_t(report.runner_up)].config.name();
    record.runner_up_tflops = report.timings[size_t(report.runner_up)].tflops;
  }
  record.default_config = report.default_config.name();
  if (report.default_index >= 0 && report.timings[size_t(report.default_index)].ok) {
    record.default_tflops = report.timings[size_t(report.default_index)].tflops;
  }
  for (const auto& t : report.timings) record.candidates_timed += t.ok ? 1 : 0;
  return record;
}

}  // namespace flashserve
