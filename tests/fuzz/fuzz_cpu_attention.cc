// libFuzzer target for the compute path: the input picks a small problem (sizes, dtype, causal,
// GQA ratio, softmax_scale, return_lse) and supplies its tensor bytes, so nearly every input is a
// valid request. It is serialized and parsed back (as gRPC does), validated, and run on the CPU
// backend with the checks of fuzz_check.h (exact-size buffers, every element written, outputs
// bounded by max|v|, LSE finite or -inf exactly for fully masked causal rows).
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

#include "fuzz_check.h"

namespace {

void SetTensor(flashserve::v1::Tensor* t, flashserve::v1::DType dtype,
               std::initializer_list<int64_t> shape, FuzzedDataProvider& input) {
  t->set_dtype(dtype);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  const size_t bytes = size_t(n) * (dtype == flashserve::v1::FLOAT32 ? 4 : 2);
  std::string data = input.ConsumeBytesAsString(bytes);
  // Short input: repeat what there is (or zeros) so the request stays valid.
  if (data.empty()) data.assign(bytes, '\0');
  while (data.size() < bytes) data.append(data, 0, std::min(data.size(), bytes - data.size()));
  t->set_data(std::move(data));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace flashserve;
  FuzzedDataProvider input(data, size);
  static const v1::DType kDTypes[] = {v1::FLOAT16, v1::BFLOAT16, v1::FLOAT32};
  const v1::DType dtype = kDTypes[input.ConsumeIntegralInRange<int>(0, 2)];
  const int batch = input.ConsumeIntegralInRange<int>(1, 3);
  const int seqlen_q = input.ConsumeIntegralInRange<int>(1, 70);
  const int seqlen_k = input.ConsumeIntegralInRange<int>(1, 70);
  const int heads_kv = input.ConsumeIntegralInRange<int>(1, 3);
  const int heads_q = heads_kv * input.ConsumeIntegralInRange<int>(1, 4);
  // Head dims around the SIMD widths and tile edges, plus the maximum.
  static const int kHeadDims[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65,
                                  96, 127, 128, 129, 255, 256};
  const int head_dim =
      kHeadDims[input.ConsumeIntegralInRange<size_t>(0, std::size(kHeadDims) - 1)];
  const bool causal = input.ConsumeBool();
  const bool return_lse = input.ConsumeBool();
  const bool set_scale = input.ConsumeBool();
  const float scale = input.ConsumeFloatingPoint<float>();

  v1::AttentionRequest request;
  SetTensor(request.mutable_q(), dtype, {batch, seqlen_q, heads_q, head_dim}, input);
  SetTensor(request.mutable_k(), dtype, {batch, seqlen_k, heads_kv, head_dim}, input);
  SetTensor(request.mutable_v(), dtype, {batch, seqlen_k, heads_kv, head_dim}, input);
  request.set_causal(causal);
  request.set_return_lse(return_lse);
  if (set_scale) request.set_softmax_scale(scale);

  // Through the wire format, as a gRPC request arrives.
  v1::AttentionRequest parsed;
  const std::string wire = request.SerializeAsString();
  FUZZ_CHECK(parsed.ParseFromString(wire), "a serialized request does not parse");

  static const ValidationLimits limits = fuzz::CpuLimits();
  absl::StatusOr<AttentionProblem> problem = ValidateAttentionRequest(parsed, limits);
  fuzz::CheckValidationResult(parsed, problem, limits);
  if (!problem.ok()) {
    // Only softmax_scale can be wrong in what we built: not finite, <= 0, or over the maximum.
    const bool scale_ok = std::isfinite(scale) && scale > 0.f && scale <= kMaxSoftmaxScale;
    FUZZ_CHECK(set_scale && !scale_ok, problem.status().ToString());
    return 0;
  }
  fuzz::RunAndCheck(fuzz::SharedBackend(), *problem, parsed);
  return 0;
}
