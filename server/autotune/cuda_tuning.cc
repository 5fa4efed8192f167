#include "autotune/cuda_tuning.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/kernel_build_id.h"

namespace flashserve {

absl::StatusOr<DeviceIdentity> DescribeCudaDevice(int device) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, ": ", cudaGetErrorString(e)));
  }
  return DeviceIdentity{prop.name, prop.major, prop.minor, prop.multiProcessorCount};
}

TuneCacheHeader CacheHeaderFor(const DeviceIdentity& device) {
  TuneCacheHeader header;
  header.device_name = device.name;
  header.cc_major = device.cc_major;
  header.cc_minor = device.cc_minor;
  header.sm_count = device.sm_count;
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

DecodeShape DecodeShapeOf(const kernels::cuda::DecodeParams& p) {
  DecodeShape s;
  s.dtype = p.dtype;
  s.head_dim = p.head_dim;
  s.heads_q = p.heads_q;
  s.heads_kv = p.heads_kv;
  s.batch = p.batch;
  s.seqlen_q = p.seqlen_q;
  s.seqlen_k = p.seqlen_k;
  s.page_size = p.block_table != nullptr ? p.page_size : 0;
  s.causal = p.causal;
  return s;
}

namespace {

kernels::cuda::DecodeParams DecodeProblemOf(const DecodeShape& s) {
  kernels::cuda::DecodeParams p = kernels::cuda::make_dense_decode_params(
      s.dtype, s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv, s.head_dim, s.causal,
      1.0f / std::sqrt(float(s.head_dim)));
  if (s.page_size > 0) {
    // tune_decode_splits ignores the problem's pointers and allocates its own; a non-null block
    // table only tells it to time the paged layout.
    static const int32_t kPagedMarker = 0;
    p.block_table = &kPagedMarker;
    p.page_size = s.page_size;
  }
  return p;
}

}  // namespace

absl::StatusOr<TuneRecord> TuneDecodeClass(const DecodeClass& c, cudaStream_t stream,
                                           const kernels::cuda::TuneOptions& options) {
  const DecodeShape shape = c.representative();
  kernels::cuda::DecodeTuneReport report;
  const cudaError_t e =
      kernels::cuda::tune_decode_splits(DecodeProblemOf(shape), stream, options, &report);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::Status(e == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                                       : absl::StatusCode::kInternal,
                        absl::StrCat("tuning ", c.key(), ": ", cudaGetErrorString(e)));
  }
  if (report.best < 0) {
    return absl::InternalError(absl::StrCat("tuning ", c.key(), ": no split count ran correctly"));
  }
  const double kv_bytes = 2.0 * shape.batch * shape.seqlen_k * shape.heads_kv * shape.head_dim *
                          (shape.dtype == kernels::DType::kFloat32 ? 4 : 2);
  auto tbs = [&](const kernels::cuda::DecodeSplitTiming& t) {
    return t.median_ms > 0 ? kv_bytes / t.median_ms / 1e9 : 0.0;
  };
  TuneRecord record;
  const auto& best = report.timings[size_t(report.best)];
  const bool heuristic_ran =
      report.heuristic_index >= 0 && report.timings[size_t(report.heuristic_index)].ok;
  const double heuristic_ms =
      heuristic_ran ? report.timings[size_t(report.heuristic_index)].median_ms : 0.0;
  // "splits=plan" unless the best count clearly beat the heuristic's here (decode_class.h).
  record.config = DecodeTunedConfig(best.num_splits, best.median_ms, heuristic_ms);
  record.default_config = DecodeSplitsConfig(report.heuristic);
  if (heuristic_ran) record.default_tflops = tbs(report.timings[size_t(report.heuristic_index)]);
  record.tflops = record.config == DecodeSplitsConfig(0) ? record.default_tflops : tbs(best);
  int runner_up = -1;
  for (size_t i = 0; i < report.timings.size(); ++i) {
    const auto& t = report.timings[i];
    record.candidates_timed += t.ok ? 1 : 0;
    if (t.ok && int(i) != report.best &&
        (runner_up < 0 || t.median_ms < report.timings[size_t(runner_up)].median_ms)) {
      runner_up = int(i);
    }
  }
  if (runner_up >= 0) {
    record.runner_up = DecodeSplitsConfig(report.timings[size_t(runner_up)].num_splits);
    record.runner_up_tflops = tbs(report.timings[size_t(runner_up)]);
  }
  return record;
}

}  // namespace flashserve
