// Validation of AttentionRequest at the edge: done once, before any allocation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "api/attention_problem.h"
#include "flashserve/v1/attention.pb.h"

namespace flashserve {

/// What the serving backend accepts and the configured size limits.
struct ValidationLimits {
  int64_t max_tensor_elements = int64_t{1} << 28;
  std::vector<kernels::DType> dtypes;  // supported element types
  std::vector<int> head_dims;          // exact list; empty means any in [1, max_head_dim]
  int max_head_dim = 256;
  std::string backend_name = "cpu";
};

/// Checks every field and returns the problem, or INVALID_ARGUMENT (malformed) /
/// RESOURCE_EXHAUSTED (over a configured limit) with a message that starts with the field.
absl::StatusOr<AttentionProblem> ValidateAttentionRequest(const v1::AttentionRequest& request,
                                                          const ValidationLimits& limits);

}  // namespace flashserve
