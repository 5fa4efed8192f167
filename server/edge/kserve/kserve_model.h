// The KServe v2 / Open Inference Protocol model flashserve presents, and the pieces of request
// conversion both edges share (REST: edge/http/kserve_json.h; gRPC: edge/grpc/kserve_grpc_convert.h).
// Pure functions: no server needed to test them.
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

namespace flashserve::kserve {

/// Settings of both KServe edges.
struct KServeOptions {
  std::string model_name = "attention";
  std::string server_version;
  // The protocol extensions this server serves (server metadata lists them): Extensions().
  std::vector<std::string> extensions = {"binary_tensor_data"};
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
  std::vector<std::string> extensions;  // KServeOptions::extensions
};

inline constexpr const char* kInputNames[3] = {"Q", "K", "V"};

/// "FP16" / "BF16" / "FP32" for a native dtype ("" for others).
absl::string_view DatatypeName(v1::DType dtype);
/// The native dtype of a KServe datatype string; INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<v1::DType> ParseDatatype(absl::string_view datatype, absl::string_view field);
/// The datatype metadata reports: the backend's first ("FP16" when none is known).
absl::string_view FirstDatatype(const ModelInfo& model);

/// NOT_FOUND unless `name` is the model and `version` is empty or the model's version.
absl::Status CheckModel(const ModelInfo& model, absl::string_view name, absl::string_view version);

/// The protocol extensions a server serves: binary_tensor_data always; system_shared_memory with
/// client regions allowed (--allow_client_shm), cuda_shared_memory too when the backend is CUDA's
/// (a client that chose its transport from the list was told of regions it could not register).
std::vector<std::string> Extensions(bool client_shm, bool cuda_backend);

/// A tensor's place in a client's shared-memory region (Triton's shared-memory extension: the
/// tensor parameters shared_memory_region, shared_memory_offset, shared_memory_byte_size).
struct ShmParams {
  std::string region;  // empty: not in shared memory
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  bool has_offset = false, has_byte_size = false;
  bool set() const { return !region.empty(); }
};

/// Which outputs a request returns, in order, and how (binary: REST binary tensor extension).
struct OutputSpec {
  enum Kind { kOut, kLse };
  Kind kind = kOut;
  bool binary = false;
  ShmParams shm;  // set: written into the client's region, not sent
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

/// A request parameter's value, from JSON or from an InferParameter.
struct ParamValue {
  enum Type { kBool, kInt, kDouble, kString, kOther };
  Type type = kOther;
  bool b = false;
  int64_t i = 0;   // kInt (INT64_MAX for a value past it: see u)
  uint64_t u = 0;  // kInt given >= 0: the value as sent, up to 2^64-1
  double d = 0;   // kInt and kDouble
  std::string s;  // kString
  bool negative = false;  // kInt given below zero
};

/// Applies one tensor parameter if it is a shared_memory_* one (true); `field` names the tensor.
absl::StatusOr<bool> ApplyShmParameter(absl::string_view field, absl::string_view key,
                                       const ParamValue& value, ShmParams* shm);
/// After all of a tensor's parameters: a region needs its byte size, offset/size need a region.
absl::Status CheckShmParams(absl::string_view field, const ShmParams& shm);

/// Applies one request parameter; unknown keys are ignored, known ones of the wrong type refused.
absl::Status ApplyParameter(absl::string_view key, const ParamValue& value, InferOptions* options);

/// An entry of the request's "outputs" list.
struct RequestedOutput {
  std::string name;
  int binary = -1;  // -1: not said; else 0/1
  ShmParams shm;
  bool classification = false;  // Triton's classification parameter (top-k classes): refused
};
/// The outputs to return: the requested ones, or O (and LSE when return_lse) when none is named.
/// INVALID_ARGUMENT for return_lse with outputs that do not name LSE (it was dropped silently)
/// and for a classification output (raw tensors were returned instead).
absl::StatusOr<std::vector<OutputSpec>> ResolveOutputs(
    const std::vector<RequestedOutput>& requested, const InferOptions& options);
/// Sets causal, softmax_scale and return_lse (LSE among the outputs) on the native request.
void ApplyOptions(const InferOptions& options, const std::vector<OutputSpec>& outputs,
                  v1::AttentionRequest* request);

/// 0, 1, 2 for "Q", "K", "V"; -1 otherwise.
int InputSlot(absl::string_view name);
v1::Tensor* TensorAt(v1::AttentionRequest* request, int slot);
absl::Status UnknownInput(absl::string_view field, absl::string_view name);
/// INVALID_ARGUMENT naming the first of Q, K, V not seen.
absl::Status CheckAllInputs(const bool seen[3]);

}  // namespace flashserve::kserve
