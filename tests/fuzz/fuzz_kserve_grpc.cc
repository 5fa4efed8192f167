// libFuzzer target for the KServe v2 gRPC infer path (server/edge/kserve/kserve_model.h): raw bytes ->
// inference::ModelInferRequest::ParseFromArray -> GrpcInferToAttention -> ValidateAttentionRequest
// -> CPU backend (small problems) -> AttentionToGrpcInfer, whose outputs must match the request.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "edge/grpc/kserve_grpc_convert.h"
#include "fuzz_check.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  inference::ModelInferRequest infer;
  if (!infer.ParseFromArray(data, int(size))) return 0;
  v1::AttentionRequest request;
  std::vector<kserve::OutputSpec> outputs;
  int64_t timeout_us = -1;
  const absl::Status converted = kserve::GrpcInferToAttention(&infer, &request, &outputs, &timeout_us);
  if (!converted.ok()) {
    FUZZ_CHECK(converted.code() == absl::StatusCode::kInvalidArgument, converted.ToString());
    FUZZ_CHECK(!converted.message().empty(), "error without a message");
    return 0;
  }
  FUZZ_CHECK(timeout_us >= 0, "negative timeout accepted");
  FUZZ_CHECK(!outputs.empty() && outputs.size() <= 2, "output count");

  static const ValidationLimits limits = fuzz::CpuLimits();
  const absl::StatusOr<AttentionProblem> problem = ValidateAttentionRequest(request, limits);
  fuzz::CheckValidationResult(request, problem, limits);
  if (!problem.ok()) return 0;
  fuzz::RunOutput run;
  if (!fuzz::RunAndCheck(fuzz::SharedBackend(), *problem, request, &run)) return 0;
  v1::AttentionResponse response;
  fuzz::FillResponse(*problem, std::move(run), &response);
  const size_t out_bytes = response.out().data().size();
  const size_t lse_bytes = response.lse().data().size();

  kserve::ModelInfo model;
  inference::ModelInferResponse reply;
  kserve::AttentionToGrpcInfer(model, infer.id(), outputs, &response, &reply);
  FUZZ_CHECK(reply.outputs_size() == int(outputs.size()) &&
                 reply.raw_output_contents_size() == int(outputs.size()),
             "reply output count");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const size_t expected = outputs[i].kind == kserve::OutputSpec::kOut ? out_bytes : lse_bytes;
    FUZZ_CHECK(reply.raw_output_contents(int(i)).size() == expected, "reply output bytes");
  }
  return 0;
}
