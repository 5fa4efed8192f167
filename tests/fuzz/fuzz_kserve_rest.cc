// libFuzzer target for the KServe v2 REST infer body (server/edge/kserve/kserve_model.h):
// input = JSON header [ '\0' binary bytes ], i.e. the body with Inference-Header-Content-Length
// at the first NUL (JSON text cannot contain a raw NUL); no NUL: the whole body is JSON. A second
// NUL right after the first stands for a chunked body (binary length unknown).
// ParseRestInferHeader -> binary inputs filled in order, as kserve_rest.cc's reader does ->
// ValidateAttentionRequest -> CPU backend (small problems) -> BuildRestInferResponse, whose JSON
// header must parse and whose binary parts must match the outputs.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "edge/http/kserve_json.h"
#include "fuzz_check.h"
#include "nlohmann/json.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  const char* begin = reinterpret_cast<const char*>(data);
  const char* nul = static_cast<const char*>(std::memchr(begin, '\0', size));
  const absl::string_view header(begin, nul ? size_t(nul - begin) : size);
  absl::string_view binary;
  int64_t binary_bytes = 0;
  if (nul != nullptr) {
    binary = absl::string_view(nul + 1, size - header.size() - 1);
    binary_bytes = int64_t(binary.size());
    if (!binary.empty() && binary.front() == '\0') {
      binary.remove_prefix(1);
      binary_bytes = -1;  // chunked: the parser must bound the sizes by max_binary_bytes
    }
  }
  constexpr int64_t kMaxBinaryBytes = 1 << 16;

  kserve::RestInferRequest infer;
  const absl::Status parsed =
      kserve::ParseRestInferHeader(header, binary_bytes, kMaxBinaryBytes, &infer);
  if (!parsed.ok()) {
    const int http = kserve::HttpStatusFor(parsed);
    FUZZ_CHECK(http == 400 || http == 413 || http == 404, parsed.ToString());
    FUZZ_CHECK(!parsed.message().empty(), "error without a message");
    const std::string error = kserve::ErrorJson(parsed.message());
    FUZZ_CHECK(!nlohmann::json::parse(error, nullptr, false).is_discarded(), error);
    return 0;
  }
  int64_t wanted = 0;
  for (const std::string* target : infer.binary_targets) wanted += int64_t(target->size());
  FUZZ_CHECK(wanted <= kMaxBinaryBytes, "binary inputs over the limit were allocated");
  if (binary_bytes >= 0) FUZZ_CHECK(wanted == binary_bytes, "binary sizes do not add up");
  if (wanted != int64_t(binary.size())) return 0;  // chunked body of the wrong length: refused
  for (std::string* target : infer.binary_targets) {
    std::memcpy(target->data(), binary.data(), target->size());
    binary.remove_prefix(target->size());
  }

  static const ValidationLimits limits = fuzz::CpuLimits();
  const absl::StatusOr<AttentionProblem> problem = ValidateAttentionRequest(infer.request, limits);
  fuzz::CheckValidationResult(infer.request, problem, limits);
  if (!problem.ok()) return 0;
  fuzz::RunOutput run;
  if (!fuzz::RunAndCheck(fuzz::SharedBackend(), *problem, infer.request, &run)) return 0;
  v1::AttentionResponse response;
  fuzz::FillResponse(*problem, std::move(run), &response);

  kserve::ModelInfo model;
  model.dtypes = {v1::FLOAT16, v1::BFLOAT16, v1::FLOAT32};
  const kserve::RestInferResponse out = kserve::BuildRestInferResponse(model, infer, response);
  const nlohmann::json json = nlohmann::json::parse(out.header, nullptr, false);
  FUZZ_CHECK(!json.is_discarded() && json.is_object(), "response header is not JSON: " + out.header);
  FUZZ_CHECK(json.at("outputs").size() == infer.outputs.size(), "output count");
  int64_t binary_out = 0;
  for (const kserve::OutputSpec& spec : infer.outputs) {
    if (!spec.binary) continue;
    binary_out += int64_t(spec.kind == kserve::OutputSpec::kOut ? response.out().data().size()
                                                                : response.lse().data().size());
  }
  FUZZ_CHECK(out.binary_bytes() == binary_out, "binary output bytes");
  return 0;
}
