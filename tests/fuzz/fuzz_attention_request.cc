// libFuzzer target: raw bytes -> AttentionRequest::ParseFromArray -> ValidateAttentionRequest
// (the CPU backend's limits, a small element limit and CUDA-like limits) -> for a valid, small
// problem, the CPU backend itself. This is the path every gRPC request takes after gRPC has
// parsed it. Crashes, sanitizer reports and broken invariants (fuzz_check.h) abort.
#include <cstddef>
#include <cstdint>

#include "fuzz_check.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  static const ValidationLimits limit_sets[] = {fuzz::CpuLimits(), fuzz::CpuLimits(64),
                                                fuzz::CudaLikeLimits()};
  v1::AttentionRequest request;
  if (!request.ParseFromArray(data, int(size))) return 0;
  for (const ValidationLimits& limits : limit_sets) {
    absl::StatusOr<AttentionProblem> problem = ValidateAttentionRequest(request, limits);
    fuzz::CheckValidationResult(request, problem, limits);
    if (&limits == &limit_sets[0] && problem.ok()) {
      fuzz::RunAndCheck(fuzz::SharedBackend(), *problem, request);
    }
  }
  return 0;
}
