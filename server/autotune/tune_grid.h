// A grid of problem classes to tune ahead of time (flashserve-tune, --autotune=startup).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "autotune/problem_class.h"

namespace flashserve {

struct TunePoint {
  kernels::DType dtype = kernels::DType::kBFloat16;
  int head_dim = 128;
  bool causal = false;
  int seqlen_q = 0, seqlen_k = 0;
  int gqa_ratio = 1;  // heads_q / heads_kv
};

struct TuneGrid {
  std::vector<TunePoint> points;
};

/// Builds the cross product of flag-style lists: dtypes "bf16,fp16"; head_dims "64,128";
/// causal "yes,no" (or "both"); seqlens "512,1024,1024:8192" (q or q:k); gqa "1,4".
absl::StatusOr<TuneGrid> ParseTuneGrid(const std::string& dtypes, const std::string& head_dims,
                                       const std::string& causal, const std::string& seqlens,
                                       const std::string& gqa);

/// Reads a shapes file: one problem per line, "dtype head_dim causal seqlen_q seqlen_k [gqa]",
/// e.g. "bf16 128 causal 4096 4096 4"; '#' starts a comment.
absl::StatusOr<TuneGrid> ReadShapesFile(const std::string& path);

/// The distinct classes the grid covers on `device`, in grid order.
std::vector<ProblemClass> GridClasses(const TuneGrid& grid, const DeviceIdentity& device);

}  // namespace flashserve
