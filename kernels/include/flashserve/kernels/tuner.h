// Autotuner for the CUDA kernel family: times every candidate configuration on one problem.
// No server dependency; the server's background tuner and the flashserve-tune CLI call it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/decode_attention.h"
#include "flashserve/kernels/kernel_config.h"

namespace flashserve::kernels::cuda {

struct TuneOptions {
  int warmup = 3;            ///< untimed launches per candidate
  int repetitions = 20;      ///< timed launches per candidate (median taken); >= 20
  size_t rotate_bytes = size_t{256} << 20;  ///< input sets rotated so their total exceeds L2
};

struct CandidateTiming {
  KernelConfig config;
  bool ok = false;         ///< ran and matched the default configuration's output
  std::string error;       ///< why not ok
  double median_ms = 0;
  double tflops = 0;       ///< attention_flops(problem) / median time
  double max_abs_diff = 0; ///< vs the default configuration's output
};

struct TuneReport {
  KernelConfig default_config;          ///< select(problem, sm_count)
  std::vector<CandidateTiming> timings;  ///< every candidate, in candidates() order
  int best = -1;                        ///< index into timings of the fastest ok candidate
  int runner_up = -1;                   ///< second fastest ok candidate, or -1
  int default_index = -1;               ///< index of default_config in timings
};

/// Times every candidate of candidates(problem.dtype, problem.head_dim, problem.causal) on the
/// current device and `stream` (the caller picks a low-priority stream for background tuning).
/// `problem`'s pointers are ignored: the tuner allocates its own buffers (freed before return),
/// fills them with random values, checks each candidate's output against the default
/// configuration's (a candidate that fails or differs beyond rounding is marked not ok), and
/// times the rest with CUDA events (warm-up, median of repetitions, rotating input sets).
/// Returns cudaErrorInvalidValue if supported(problem) is not empty, cudaErrorMemoryAllocation
/// if the buffers do not fit, or the first CUDA error; cudaSuccess with report->best >= 0 otherwise.
cudaError_t tune(const AttentionParams& problem, cudaStream_t stream, const TuneOptions& options,
                 TuneReport* report);

struct DecodeSplitTiming {
  int num_splits = 1;
  bool ok = false;          ///< ran and matched the heuristic's output
  std::string error;        ///< why not ok
  double median_ms = 0;
  double max_abs_diff = 0;  ///< vs the heuristic's output
};

struct DecodeTuneReport {
  int heuristic = 1;                       ///< decode_num_splits(problem, sm_count)
  std::vector<DecodeSplitTiming> timings;  ///< decode_split_candidates() order (ascending)
  int heuristic_index = -1;                ///< index of the heuristic's count in timings
  int best = -1;                           ///< fastest ok candidate
};

/// Decode (kernels/cuda/decode/decode_tune.cu): times run_decode with every split count of
/// decode_split_candidates(problem, sm_count) on the tuner's own random inputs with problem's
/// sizes (fixed lengths: seqlen_q, seqlen_k; paged with problem.page_size when problem has a
/// block table, else dense; problem's pointers are ignored), after checking each count's output
/// against the heuristic's (4 ulps of max |O|, NaN fails). Same timing method as tune().
/// cudaErrorInvalidValue for an unsupported problem; cudaSuccess with report->best >= 0 otherwise.
cudaError_t tune_decode_splits(const DecodeParams& problem, cudaStream_t stream,
                               const TuneOptions& options, DecodeTuneReport* report);

}  // namespace flashserve::kernels::cuda
