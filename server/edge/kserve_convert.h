// KServe v2 / Open Inference Protocol <-> flashserve.v1 conversions shared by the REST and gRPC
// edges: the model's tensors and parameters, the request parameters, the requested outputs, and
// the HTTP status of an absl::Status. Pure functions: no server needed to test them.
//
// The model: inputs Q, K, V (FP16, BF16 or FP32, [batch, seqlen, heads, head_dim]); outputs O
// (like Q) and LSE (FP32 [batch, heads_q, seqlen_q], only when asked for); request parameters
// causal (bool), softmax_scale (number), return_lse (bool), timeout (int, microseconds).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "flashserve/v1/attention.pb.h"
#include "inference/open_inference_grpc.pb.h"

namespace flashserve::kserve {

/// Settings of both KServe edges (from flags in main).
struct KServeOptions {
  std::string model_name = "attention";
  std::string server_version;
  int64_t max_request_bytes = int64_t{1} << 30;  // REST: largest body accepted
};

/// What the KServe edges present; the model has a single version.
struct ModelInfo {
  std::string name = "attention";
  std::string version = "1";
  std::string platform = "flashserve";
  std::string server_name = "flashserve";
  std::string server_version;
  std::vector<v1::DType> dtypes;  // supported input datatypes, first one reported in metadata
};

/// "FP16" / "BF16" / "FP32" for a native dtype ("" for others).
absl::string_view DatatypeName(v1::DType dtype);
/// The native dtype of a KServe datatype string; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<v1::DType> ParseDatatype(absl::string_view datatype, absl::string_view field);

/// NOT_FOUND unless `name` is the model and `version` is empty or the model's version.
absl::Status CheckModel(const ModelInfo& model, absl::string_view name, absl::string_view version);

/// HTTP status for a failed request: 400 INVALID_ARGUMENT / FAILED_PRECONDITION / OUT_OF_RANGE,
/// 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED naming a size
/// limit flag (--max_tensor_elements, --max_request_bytes), 503 other RESOURCE_EXHAUSTED (queue
/// full, in-flight bytes, device memory: overload) and UNAVAILABLE / CANCELLED / ABORTED,
/// 504 DEADLINE_EXCEEDED, 501 UNIMPLEMENTED, 500 otherwise.
int HttpStatusFor(const absl::Status& status);
/// `{"error":"<message>"}`.
std::string ErrorJson(absl::string_view message);

/// Which outputs a request returns, in order, and how (binary: REST binary tensor extension).
struct OutputSpec {
  enum Kind { kOut, kLse };
  Kind kind = kOut;
  bool binary = false;
};

/// The parsed request parameters.
struct InferOptions {
  bool causal = false;
  bool has_softmax_scale = false;
  double softmax_scale = 0.0;
  bool return_lse = false;
  bool binary_data_output = false;  // REST: outputs as binary unless an output says otherwise
  int64_t timeout_us = 0;           // 0: no server-side deadline
};

/// One REST infer request's JSON header, converted. Binary inputs have their data strings sized
/// already; the caller fills them, in order, from the bytes after the header.
struct RestInferRequest {
  v1::AttentionRequest request;
  std::vector<std::string*> binary_targets;  // into request.{q,k,v}.data, in input order
  std::vector<OutputSpec> outputs;
  std::string id;
  bool has_id = false;
  int64_t timeout_us = 0;
};

/// Parses the JSON header of POST .../infer. `binary_bytes` is the number of bytes that follow
/// the header (-1 when unknown: chunked body); the inputs' binary_data_size must add up to it
/// (to at most `max_binary_bytes` when unknown) before anything is allocated.
absl::Status ParseRestInferHeader(absl::string_view json, int64_t binary_bytes,
                                  int64_t max_binary_bytes, RestInferRequest* out);

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

/// Converts a ModelInferRequest, moving raw_input_contents into `out`'s tensors (no copy; the
/// request is left without them). FP32 inputs may use contents.fp32_contents instead.
absl::Status GrpcInferToAttention(inference::ModelInferRequest* request, v1::AttentionRequest* out,
                                  std::vector<OutputSpec>* outputs, int64_t* timeout_us);
/// Fills a ModelInferResponse, moving the tensor bytes out of `response` (no copy).
void AttentionToGrpcInfer(const ModelInfo& model, const std::string& id,
                          const std::vector<OutputSpec>& outputs, v1::AttentionResponse* response,
                          inference::ModelInferResponse* out);
void FillGrpcModelMetadata(const ModelInfo& model, inference::ModelMetadataResponse* out);

/// JSON body of GET /v2, and of GET /v2/models/<name>.
std::string ServerMetadataJson(const ModelInfo& model);
std::string ModelMetadataJson(const ModelInfo& model);
/// {"name": <model>, "ready": <ready>} of GET /v2/models/<name>/ready.
std::string ModelReadyJson(const ModelInfo& model, bool ready);
/// The protocol extensions served ("binary_tensor_data").
const std::vector<std::string>& Extensions();

}  // namespace flashserve::kserve
