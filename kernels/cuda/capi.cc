// C ABI over the CUDA kernels for ctypes (bench/kernels/bench_vs_torch.py) and other FFI users.
// Raw pointers, sizes and element strides in; cudaError_t values (0 = success) out. Never throws.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "flashserve/kernels/cuda_attention.h"
#include "flashserve/kernels/tuner.h"

namespace {

using flashserve::kernels::AttentionParams;
using flashserve::kernels::DType;
namespace fk = flashserve::kernels::cuda;

// strides: 12 element strides, (batch, row, head) for q, k, v, o in that order.
AttentionParams make_params(int dtype, const void* q, const void* k, const void* v, void* o,
                            float* lse, int batch, int seqlen_q, int seqlen_k, int heads_q,
                            int heads_kv, int head_dim, const int64_t* strides,
                            float softmax_scale, int causal) {
  AttentionParams p;
  p.dtype = static_cast<DType>(dtype);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = o;
  p.lse = lse;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.softmax_scale = softmax_scale;
  p.softmax_scale_log2 = softmax_scale * 1.4426950408889634f;
  p.causal = causal != 0;
  p.q_batch_stride = strides[0], p.q_row_stride = strides[1], p.q_head_stride = strides[2];
  p.k_batch_stride = strides[3], p.k_row_stride = strides[4], p.k_head_stride = strides[5];
  p.v_batch_stride = strides[6], p.v_row_stride = strides[7], p.v_head_stride = strides[8];
  p.o_batch_stride = strides[9], p.o_row_stride = strides[10], p.o_head_stride = strides[11];
  return p;
}

int copy_out(const std::string& s, char* buf, int buf_len) {
  if (buf != nullptr && buf_len > 0) {
    const size_t n = std::min(s.size(), size_t(buf_len - 1));
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(s.size());
}

}  // namespace

extern "C" {

/// Forward attention. dtype: 1 = fp16, 2 = bf16 (flashserve::kernels::DType). config: a
/// KernelConfig name ("m128n64w4s2") or nullptr / "" for the heuristic default.
/// stream: a cudaStream_t (e.g. torch.cuda.current_stream().cuda_stream). Returns cudaError_t.
__attribute__((visibility("default"))) int flashserve_attention_forward(
    int dtype, const void* q, const void* k, const void* v, void* o, float* lse, int batch,
    int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim, const int64_t* strides,
    float softmax_scale, int causal, const char* config, void* stream) {
  const AttentionParams p = make_params(dtype, q, k, v, o, lse, batch, seqlen_q, seqlen_k,
                                        heads_q, heads_kv, head_dim, strides, softmax_scale, causal);
  const auto s = static_cast<cudaStream_t>(stream);
  if (config == nullptr || config[0] == '\0') return fk::run(p, s);
  const std::optional<fk::KernelConfig> cfg = fk::KernelConfig::parse(config);
  if (!cfg) return cudaErrorInvalidValue;
  return fk::run(p, *cfg, s);
}

/// Variable-length forward attention (AttentionParams::cu_seqlens_q/k): q/o packed
/// [total_q, heads_q, head_dim], k/v packed [total_k, heads_kv, head_dim], cu_seqlens_q/k device
/// int32 [batch + 1]; max_seqlen_q/k the longest sequence; lse [heads_q, total_q] or nullptr;
/// total_k the rows of k/v (0: unknown, then only the sm80 family runs it).
/// strides: 8 element strides, (row, head) for q, k, v, o. config as in
/// flashserve_attention_forward. Returns cudaError_t.
__attribute__((visibility("default"))) int flashserve_attention_forward_varlen(
    int dtype, const void* q, const void* k, const void* v, void* o, float* lse,
    const int* cu_seqlens_q, const int* cu_seqlens_k, int batch, int max_seqlen_q, int max_seqlen_k,
    int total_q, int total_k, int heads_q, int heads_kv, int head_dim, const int64_t* strides,
    float softmax_scale, int causal, const char* config, void* stream) {
  const int64_t s12[12] = {0, strides[0], strides[1], 0, strides[2], strides[3],
                           0, strides[4], strides[5], 0, strides[6], strides[7]};
  AttentionParams p = make_params(dtype, q, k, v, o, lse, batch, max_seqlen_q, max_seqlen_k,
                                  heads_q, heads_kv, head_dim, s12, softmax_scale, causal);
  p.cu_seqlens_q = cu_seqlens_q;
  p.cu_seqlens_k = cu_seqlens_k;
  p.total_q = total_q;
  p.total_k = total_k;
  const auto s = static_cast<cudaStream_t>(stream);
  if (config == nullptr || config[0] == '\0') return fk::run(p, s);
  const std::optional<fk::KernelConfig> cfg = fk::KernelConfig::parse(config);
  if (!cfg) return cudaErrorInvalidValue;
  return fk::run(p, *cfg, s);
}

/// Writes supported()'s message (empty: supported) into buf; returns its length.
__attribute__((visibility("default"))) int flashserve_attention_supported(
    int dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
    int causal, char* buf, int buf_len) {
  AttentionParams p = flashserve::kernels::make_contiguous_params(
      static_cast<DType>(dtype), batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
      causal != 0, 1.0f);
  static const char kDummy[16] __attribute__((aligned(16))) = {};
  p.q = p.k = p.v = kDummy;
  p.o = const_cast<char*>(kDummy);
  return copy_out(fk::supported(p), buf, buf_len);
}

/// Number of autotuning candidates for (dtype, head_dim, causal).
__attribute__((visibility("default"))) int flashserve_attention_num_candidates(int dtype,
                                                                                int head_dim,
                                                                                int causal) {
  return static_cast<int>(fk::candidates(static_cast<DType>(dtype), head_dim, causal != 0).size());
}

/// Name of candidate index (0 = the heuristic default for large problems); returns its length.
__attribute__((visibility("default"))) int flashserve_attention_candidate_name(
    int dtype, int head_dim, int causal, int index, char* buf, int buf_len) {
  const auto all = fk::candidates(static_cast<DType>(dtype), head_dim, causal != 0);
  if (index < 0 || index >= static_cast<int>(all.size())) return -1;
  return copy_out(all[index].name(), buf, buf_len);
}

/// Name of select()'s choice for a contiguous problem on a GPU with sm_count SMs.
__attribute__((visibility("default"))) int flashserve_attention_select_name(
    int dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
    int causal, int sm_count, char* buf, int buf_len) {
  const AttentionParams p = flashserve::kernels::make_contiguous_params(
      static_cast<DType>(dtype), batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
      causal != 0, 1.0f);
  return copy_out(fk::select(p, sm_count).name(), buf, buf_len);
}

/// Runs the autotuner (flashserve::kernels::cuda::tune) on a contiguous problem with
/// softmax_scale = 1/sqrt(head_dim). Per candidate i (candidates() order, as
/// flashserve_attention_candidate_name; at most `capacity`): median_ms[i], ok[i] (1: ran and
/// matched the default's output), max_abs_diff[i]. *best / *default_index: indices (best -1 on
/// error); *count: number of candidates. Any output pointer may be null. Returns cudaError_t.
__attribute__((visibility("default"))) int flashserve_attention_tune(
    int dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
    int causal, int warmup, int repetitions, void* stream, int capacity, double* median_ms,
    int* ok, double* max_abs_diff, int* best, int* default_index, int* count) {
  const AttentionParams p = flashserve::kernels::make_contiguous_params(
      static_cast<DType>(dtype), batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
      causal != 0, 1.0f / std::sqrt(static_cast<float>(head_dim > 0 ? head_dim : 1)));
  fk::TuneOptions options;
  options.warmup = warmup;
  options.repetitions = repetitions;
  fk::TuneReport report;
  const cudaError_t err = fk::tune(p, static_cast<cudaStream_t>(stream), options, &report);
  const int n = static_cast<int>(report.timings.size());
  for (int i = 0; i < n && i < capacity; ++i) {
    if (median_ms != nullptr) median_ms[i] = report.timings[i].median_ms;
    if (ok != nullptr) ok[i] = report.timings[i].ok ? 1 : 0;
    if (max_abs_diff != nullptr) max_abs_diff[i] = report.timings[i].max_abs_diff;
  }
  if (best != nullptr) *best = report.best;
  if (default_index != nullptr) *default_index = report.default_index;
  if (count != nullptr) *count = n;
  return static_cast<int>(err);
}

}  // extern "C"
