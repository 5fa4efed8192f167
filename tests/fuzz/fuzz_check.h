// Shared helpers for the libFuzzer targets: an always-on check that reports and aborts (so
// libFuzzer records a crash and writes the input), and the oracle for one CPU attention run.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "api/attention_problem.h"
#include "api/validation.h"
#include "flashserve/kernels/float_convert.h"
#include "google/protobuf/stubs/logging.h"
#include "runtime/cpu_backend.h"

/// Like assert(), but also in release builds; prints the condition and a note.
#define FUZZ_CHECK(cond, note)                                                      \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "FUZZ_CHECK failed at %s:%d: %s\n  %s\n", __FILE__,      \
                   __LINE__, #cond, std::string(note).c_str());                     \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)

namespace flashserve::fuzz {

/// Silences protobuf's own log lines (e.g. "String field ... contains invalid UTF-8"), which the
/// parse targets would otherwise print thousands of times a second. Call from LLVMFuzzerInitialize.
inline void QuietProtobuf() {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
}

/// The CPU backend's validation limits, as main.cc builds them for --backend=cpu.
inline ValidationLimits CpuLimits(int64_t max_tensor_elements = int64_t{1} << 28) {
  ValidationLimits limits;
  limits.max_tensor_elements = max_tensor_elements;
  limits.dtypes = {kernels::DType::kFloat16, kernels::DType::kBFloat16, kernels::DType::kFloat32};
  limits.max_head_dim = kernels::cpu::kMaxHeadDim;
  limits.backend_name = "cpu";
  return limits;
}

/// The CUDA backend's shape of limits (an explicit head_dim list, no fp32).
inline ValidationLimits CudaLikeLimits() {
  ValidationLimits limits;
  limits.max_tensor_elements = 4096;
  limits.dtypes = {kernels::DType::kFloat16, kernels::DType::kBFloat16};
  limits.head_dims = {64, 128};
  limits.backend_name = "cuda";
  return limits;
}

/// What every validation answer must look like, valid or not.
inline void CheckValidationResult(const v1::AttentionRequest& request,
                                  const absl::StatusOr<AttentionProblem>& result,
                                  const ValidationLimits& limits) {
  if (!result.ok()) {
    const absl::StatusCode code = result.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument ||
                   code == absl::StatusCode::kResourceExhausted,
               result.status().ToString());
    const std::string message(result.status().message());
    // DESIGN.md: the message names the field first.
    const bool names_field = message.rfind("q", 0) == 0 || message.rfind("k", 0) == 0 ||
                             message.rfind("v", 0) == 0 || message.rfind("head_dim", 0) == 0 ||
                             message.rfind("softmax_scale", 0) == 0;
    FUZZ_CHECK(names_field, message);
    return;
  }
  const AttentionProblem& p = *result;
  FUZZ_CHECK(p.batch > 0 && p.seqlen_q > 0 && p.seqlen_k > 0 && p.heads_q > 0 && p.heads_kv > 0 &&
                 p.head_dim > 0,
             "non-positive size accepted");
  FUZZ_CHECK(p.heads_q % p.heads_kv == 0, "heads_q not a multiple of heads_kv accepted");
  FUZZ_CHECK(std::isfinite(p.softmax_scale) && p.softmax_scale > 0.f, "bad scale accepted");
  // Past kMaxSoftmaxScale fp32 logits overflow for ordinary inputs (NaN rows).
  FUZZ_CHECK(p.softmax_scale <= kMaxSoftmaxScale, "scale over kMaxSoftmaxScale accepted");
  FUZZ_CHECK(p.q_elements() <= limits.max_tensor_elements &&
                 p.kv_elements() <= limits.max_tensor_elements,
             "tensor over max_tensor_elements accepted");
  FUZZ_CHECK(p.q_bytes() == int64_t(request.q().data().size()), "q byte length mismatch");
  FUZZ_CHECK(p.kv_bytes() == int64_t(request.k().data().size()), "k byte length mismatch");
  FUZZ_CHECK(p.kv_bytes() == int64_t(request.v().data().size()), "v byte length mismatch");
  if (limits.head_dims.empty()) {
    FUZZ_CHECK(p.head_dim <= limits.max_head_dim, "head_dim over the maximum accepted");
  }
}

/// Largest problem (multiply-adds batch*heads_q*seqlen_q*seqlen_k*head_dim) the fuzzers compute:
/// keeps one execution in the milliseconds under ASan.
inline constexpr int64_t kMaxFuzzMacs = int64_t{1} << 18;

inline int64_t Macs(const AttentionProblem& p) {
  return int64_t{p.batch} * p.heads_q * p.seqlen_q * p.seqlen_k * p.head_dim;
}

inline float MaxAbs(const void* data, int64_t n, kernels::DType dtype, bool* all_finite) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float x = kernels::load_element(data, i, dtype);
    if (!std::isfinite(x)) *all_finite = false;
    else m = std::max(m, std::fabs(x));
  }
  return m;
}

/// "fp16 q[1,5,4,64] kv[1,7,2,64] causal lse scale=0.125": for failure messages.
inline std::string Describe(const AttentionProblem& p) {
  return std::string(kernels::dtype_name(p.dtype)) + " q[" + std::to_string(p.batch) + "," +
         std::to_string(p.seqlen_q) + "," + std::to_string(p.heads_q) + "," +
         std::to_string(p.head_dim) + "] kv[" + std::to_string(p.batch) + "," +
         std::to_string(p.seqlen_k) + "," + std::to_string(p.heads_kv) + "," +
         std::to_string(p.head_dim) + "]" + (p.causal ? " causal" : "") +
         (p.return_lse ? " lse" : "") + " scale=" + std::to_string(p.softmax_scale);
}

/// What one CPU run produced: exactly-sized buffers (ASan sees any overrun).
struct RunOutput {
  std::vector<unsigned char> out;  // out_bytes(), dtype of the problem
  std::vector<float> lse;          // lse_elements()
  std::string kernel;
  PhaseTiming timing;
};

/// Runs `p` on the CPU backend into buffers poisoned with NaN first (so an unwritten element is
/// caught), and checks what exact attention guarantees: with finite inputs whose logits cannot
/// overflow, every output element is finite and within max|v| (a convex combination of V rows);
/// LSE is finite, or -inf exactly for a causal row that sees no key (whose output is then 0).
/// False (nothing run) when the problem is over kMaxFuzzMacs.
inline bool RunAndCheck(CpuBackend& backend, const AttentionProblem& p,
                        const v1::AttentionRequest& request, RunOutput* result = nullptr) {
  if (Macs(p) > kMaxFuzzMacs) return false;
  RunOutput local;
  RunOutput& r = result != nullptr ? *result : local;
  r.out.assign(size_t(p.out_bytes()), 0xFF);  // 0xFF..: NaN in every dtype
  r.lse.assign(size_t(p.lse_elements()), std::nanf(""));
  BackendJob job;
  job.problem = p;
  const v1::Tensor* inputs[3] = {&request.q(), &request.k(), &request.v()};
  TensorBytes* tensors[3] = {&job.tensors.q, &job.tensors.k, &job.tensors.v};
  for (int i = 0; i < 3; ++i) {
    *tensors[i] = TensorBytes::Contiguous(MemoryKind::kHeap, inputs[i]->data().data(),
                                          inputs[i]->data().size());
  }
  job.tensors.o = {MemoryKind::kHeap, reinterpret_cast<char*>(r.out.data()), r.out.size()};
  if (p.return_lse) {
    job.tensors.lse = {MemoryKind::kHeap, reinterpret_cast<char*>(r.lse.data()),
                       r.lse.size() * sizeof(float)};
  }
  absl::Status status = backend.Run(job, &r.timing, &r.kernel);
  FUZZ_CHECK(status.ok(), status.ToString());
  FUZZ_CHECK(!r.kernel.empty(), "no kernel name");

  bool finite = true;
  const float max_q = MaxAbs(job.tensors.q.data(), p.q_elements(), p.dtype, &finite);
  const float max_k = MaxAbs(job.tensors.k.data(), p.kv_elements(), p.dtype, &finite);
  const float max_v = MaxAbs(job.tensors.v.data(), p.kv_elements(), p.dtype, &finite);
  // The kernels form q.k in fp32 and scale it afterwards (as FlashAttention does), so both
  // |q.k| <= head_dim * max|q| * max|k| and the scaled logit must stay far below FLT_MAX, with room
  // for exp2's log2(e) and the running sums. Beyond that, NaN/inf are fp32's range, not a bug
  // this target looks for (see tests/fuzz/RESULTS.md).
  const double max_dot = double(p.head_dim) * max_q * max_k;
  const double max_logit = double(p.softmax_scale) * max_dot;
  if (!finite || max_dot > 1e30 || max_logit > 1e30 || max_v > 1e30f) return true;

  const int64_t n_out = p.q_elements();
  const double bound = double(max_v) * (1 + 1e-3) + 1e-30;
  for (int64_t i = 0; i < n_out; ++i) {
    const float o = kernels::load_element(r.out.data(), i, p.dtype);
    FUZZ_CHECK(std::isfinite(o), "non-finite output " + std::to_string(o) + " at element " +
                                     std::to_string(i) + " of a finite problem " + Describe(p));
    FUZZ_CHECK(std::fabs(o) <= bound, "output " + std::to_string(o) + " exceeds max|v| " +
                                          std::to_string(max_v) + " at element " +
                                          std::to_string(i) + " of " + Describe(p));
  }
  if (!p.return_lse) return true;
  // lse: [batch, heads_q, seqlen_q]; row i sees key j iff j <= i + seqlen_k - seqlen_q (causal).
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      for (int i = 0; i < p.seqlen_q; ++i) {
        const float l = r.lse[(size_t(b) * p.heads_q + h) * p.seqlen_q + i];
        const bool sees_none = p.causal && int64_t{i} + p.seqlen_k - p.seqlen_q < 0;
        if (sees_none) {
          FUZZ_CHECK(std::isinf(l) && l < 0, "masked row lse " + std::to_string(l));
          for (int d = 0; d < p.head_dim; ++d) {
            const int64_t idx = ((int64_t{b} * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + d;
            FUZZ_CHECK(kernels::load_element(r.out.data(), idx, p.dtype) == 0.f,
                       "masked row output not 0");
          }
        } else {
          FUZZ_CHECK(std::isfinite(l), "lse " + std::to_string(l) + " for a row that sees keys");
        }
      }
    }
  }
  return true;
}

/// Fills `response` from a run the way AttentionRuntime::Execute does (out, lse, timing, kernel).
inline void FillResponse(const AttentionProblem& p, RunOutput&& run, v1::AttentionResponse* response) {
  v1::Tensor* out = response->mutable_out();
  out->set_dtype(static_cast<v1::DType>(p.dtype));
  for (int64_t d : {p.batch, p.seqlen_q, p.heads_q, p.head_dim}) out->add_shape(d);
  out->set_data(std::string(run.out.begin(), run.out.end()));
  if (p.return_lse) {
    v1::Tensor* lse = response->mutable_lse();
    lse->set_dtype(v1::FLOAT32);
    for (int64_t d : {p.batch, p.heads_q, p.seqlen_q}) lse->add_shape(d);
    lse->set_data(std::string(reinterpret_cast<const char*>(run.lse.data()),
                              run.lse.size() * sizeof(float)));
  }
  response->mutable_timing()->set_compute_us(run.timing.compute_us);
  response->set_kernel(run.kernel);
}

/// The CPU backend every target shares: one compute thread, so the work runs on the caller and
/// coverage and reports stay on one thread.
inline CpuBackend& SharedBackend() {
  static CpuBackend* backend = [] {
    CpuBackendOptions options;
    options.num_threads = 1;
    return CpuBackend::Create(options)->release();
  }();
  return *backend;
}

}  // namespace flashserve::fuzz
