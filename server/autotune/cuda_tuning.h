// Glue between the kernel-side tuner (kernels/cuda) and the server's cache: device identity,
// cache header, and "tune one problem class" as a TuneRecord. CUDA builds only.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"
#include "autotune/decode_class.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"
#include "flashserve/kernels/decode_attention.h"
#include "flashserve/kernels/tuner.h"

namespace flashserve {

/// Name, compute capability and SM count of CUDA device `device`.
absl::StatusOr<DeviceIdentity> DescribeCudaDevice(int device);

/// Header for a cache measured on `device` with this build's kernels.
TuneCacheHeader CacheHeaderFor(const DeviceIdentity& device);

/// Times every candidate for c's representative problem on the current device and `stream`.
absl::StatusOr<TuneRecord> TuneProblemClass(const ProblemClass& c, int sm_count,
                                            cudaStream_t stream,
                                            const kernels::cuda::TuneOptions& options = {});

/// The sizes of a decode launch that its class depends on (page_size 0 when dense).
DecodeShape DecodeShapeOf(const kernels::cuda::DecodeParams& p);

/// Times the split counts of kernels::cuda::decode_split_candidates for c's representative
/// shape (tune_decode_splits) and records the fastest as "splits=N" where it clearly beats the
/// heuristic's count, else "splits=plan" (DecodeTunedConfig); throughput in K/V TB/s.
/// Runs on the current device (its SM count is read there).
absl::StatusOr<TuneRecord> TuneDecodeClass(const DecodeClass& c, cudaStream_t stream,
                                           const kernels::cuda::TuneOptions& options = {});

}  // namespace flashserve
