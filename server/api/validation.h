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
  // > 0: the most batch and heads_q each (the CUDA kernels' grid holds them in its y and z
  // dimensions, 65535 at most); 0: no such limit.
  int64_t max_batch_and_heads = 0;
  std::string backend_name = "cpu";
};

/// Largest accepted softmax_scale. Real models use 1/sqrt(head_dim) (<= 1), temperature-scaled
/// ones at most ~100; far past that, fp32 logits softmax_scale * q.k overflow for ordinary inputs
/// and whole rows would come back NaN, so such a scale is refused instead of computed.
inline constexpr float kMaxSoftmaxScale = 1e4f;

/// Checks every field and returns the problem, or INVALID_ARGUMENT (malformed) /
/// RESOURCE_EXHAUSTED (over a configured limit) with a message that starts with the field.
/// `data_bytes` (q, k, v), when given, are the tensors' data sizes for a request whose data is
/// held outside the message (zero-copy parsing, shared memory); else their data fields' sizes.
absl::StatusOr<AttentionProblem> ValidateAttentionRequest(const v1::AttentionRequest& request,
                                                          const ValidationLimits& limits,
                                                          const int64_t* data_bytes = nullptr);

}  // namespace flashserve
