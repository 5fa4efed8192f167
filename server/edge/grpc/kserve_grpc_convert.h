// KServe v2 gRPC (inference.GRPCInferenceService) conversions: ModelInfer <-> the native request
// and response, and ModelMetadata. Pure functions: no server needed to test them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "edge/kserve/kserve_model.h"
#include "flashserve/v1/attention.pb.h"
#include "inference/open_inference_grpc.pb.h"

namespace flashserve::kserve {

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
