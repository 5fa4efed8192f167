// KServe v2 gRPC (inference.GRPCInferenceService) conversions: ModelInfer <-> the native request
// and response, and ModelMetadata. Pure functions: no server needed to test them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "edge/kserve/kserve_model.h"
#include "flashserve/v1/attention.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "inference/open_inference_grpc.pb.h"

namespace flashserve::kserve {

/// At most this many objects (CheckWireObjects) in one KServe request: a ModelInfer needs a few
/// dozen; parsed, 65536 hold ~16 MiB at most.
inline constexpr int64_t kMaxWireObjects = int64_t{1} << 16;

/// Checks the wire bytes of a `type` message before protobuf parses them: a field that parses
/// into an object of its own (a submessage or map entry, a string, an unknown field, an element
/// of a repeated integer sent unpacked) costs tens to hundreds of bytes for the 2 it takes on the
/// wire. A 32 MiB ModelInfer of empty `inputs` held 3.6 GiB while it parsed, a 32 MiB ServerLive
/// (open without a token) of unknown fields 1 GiB: at --max_request_bytes (1 GiB) the server
/// ran out of memory. INVALID_ARGUMENT past `max_objects` or nested past 32 levels; bytes that
/// do not parse are left for the parse to refuse.
absl::Status CheckWireObjects(google::protobuf::io::ZeroCopyInputStream* input,
                              const google::protobuf::Descriptor& type,
                              int64_t max_objects = kMaxWireObjects);

/// Converts a ModelInferRequest, moving raw_input_contents into `out`'s tensors (no copy; the
/// request is left without them). FP32 inputs may use contents.fp32_contents instead.
/// Inputs in a client's shared-memory region (parameters shared_memory_*) have no contents and no
/// raw_input_contents entry (as tritonclient sends them): their place goes to shm_inputs[slot]
/// (Q, K, V), or they are refused when shm_inputs is null.
absl::Status GrpcInferToAttention(inference::ModelInferRequest* request, v1::AttentionRequest* out,
                                  std::vector<OutputSpec>* outputs, int64_t* timeout_us,
                                  ShmParams* shm_inputs = nullptr);
/// Fills a ModelInferResponse, moving the tensor bytes out of `response` (no copy); an output in
/// shared memory gets an empty raw_output_contents entry (one per output, as tritonclient reads).
void AttentionToGrpcInfer(const ModelInfo& model, const std::string& id,
                          const std::vector<OutputSpec>& outputs, v1::AttentionResponse* response,
                          inference::ModelInferResponse* out);
void FillGrpcModelMetadata(const ModelInfo& model, inference::ModelMetadataResponse* out);

}  // namespace flashserve::kserve
