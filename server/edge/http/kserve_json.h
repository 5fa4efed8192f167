// KServe v2 REST (JSON) conversions: the infer request's JSON header, the response, metadata
// documents and the HTTP status of an absl::Status. Pure functions: no server needed to test them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "api/validation.h"
#include "common/http_status.h"
#include "edge/http/json_text.h"
#include "edge/kserve/kserve_model.h"
#include "flashserve/v1/attention.pb.h"
#include "nlohmann/json_fwd.hpp"

namespace flashserve::kserve {

/// The HTTP middleware's status conversion (common/http_status.h), for the REST code and tests.
inline int HttpStatusFor(const absl::Status& status) { return flashserve::HttpStatusFor(status); }
/// `{"error":"<message>"}`.
std::string ErrorJson(absl::string_view message);

/// One REST infer request's JSON header, converted. Binary inputs have their data strings sized
/// already; the caller fills them, in order, from the bytes after the header.
struct RestInferRequest {
  v1::AttentionRequest request;
  std::vector<std::string*> binary_targets;  // into request.{q,k,v}.data, in input order
  std::vector<int64_t> binary_sizes;         // their binary_data_size, in the same order
  std::vector<OutputSpec> outputs;
  ShmParams shm_inputs[3];  // Q, K, V in a client's shared-memory region (data left empty)
  std::string id;
  bool has_id = false;
  int64_t timeout_us = 0;
};

/// What ParseRestInferHeader checks before it allocates a binary input.
struct RestHeaderChecks {
  /// Set: the request's shapes, dtypes and sizes (binary_data_size, JSON data) are validated
  /// with ValidateAttentionRequest, as the native API does, before any binary input is allocated.
  const ValidationLimits* validation = nullptr;
  /// Set: called with the binary inputs' total size right before they are allocated; an error
  /// (e.g. the edge's receive budget is spent) is returned and nothing is allocated.
  std::function<absl::Status(int64_t bytes)> reserve;
  /// Binary inputs get their capacity, not their size: the caller appends the bytes as they come,
  /// so memory is touched (and counts in RSS) only as the body arrives.
  bool capacity_only = false;
};

/// Parses the JSON header of POST .../infer. `binary_bytes` is the number of bytes that follow
/// the header (-1 when unknown: chunked body); the inputs' binary_data_size must add up to it
/// (to at most `max_binary_bytes` when unknown) before anything is allocated.
absl::Status ParseRestInferHeader(absl::string_view json, int64_t binary_bytes,
                                  int64_t max_binary_bytes, RestInferRequest* out,
                                  const RestHeaderChecks& checks = {});

/// The response of a finished REST inference: `header` is the JSON; `binary` lists the tensor
/// byte ranges to append after it, in order (they point into `response`).
struct RestInferResponse {
  std::string header;
  std::vector<absl::string_view> binary;
  bool has_binary() const { return !binary.empty(); }
  int64_t binary_bytes() const;
};
RestInferResponse BuildRestInferResponse(const ModelInfo& model, const RestInferRequest& request,
                                         const v1::AttentionResponse& response);

/// JSON body of GET /v2, and of GET /v2/models/<name>.
std::string ServerMetadataJson(const ModelInfo& model);
std::string ModelMetadataJson(const ModelInfo& model);
/// {"name": <model>, "ready": <ready>} of GET /v2/models/<name>/ready.
std::string ModelReadyJson(const ModelInfo& model, bool ready);

}  // namespace flashserve::kserve
