// Correctness of the CUDA forward kernels against fp64 and dtype-emulating CPU references,
// on fresh random inputs, over odd sizes, GQA, causal with seqlen_q != seqlen_k, LSE, and every
// compiled configuration. Tolerance: the kernel's error against fp64 may be at most twice the
// error of reference::attention_emulated with that configuration's emulation options (which
// round inputs and P like the kernel: its key blocks, their order, its rescale threshold).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "gpu_test_util.h"
#include "flashserve/kernels/float_convert.h"
#include "flashserve/kernels/reference_attention.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;

using testing_util::gpu_available;

uint64_t fresh_seed() {
  static const uint64_t seed = [] {
    std::random_device rd;
    const uint64_t s = (uint64_t(rd()) << 32) ^ rd();
    std::printf("cuda_attention_test seed: %llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Device buffer owned for one test.
struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Case {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
  bool causal;
  float input_scale;  // > 1: large logits
};

std::string case_name(DType dtype, int head_dim, const Case& c) {
  return std::string(dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" + std::to_string(head_dim) +
         "_b" + std::to_string(c.batch) + "_sq" + std::to_string(c.seqlen_q) + "_sk" +
         std::to_string(c.seqlen_k) + "_h" + std::to_string(c.heads_q) + "x" +
         std::to_string(c.heads_kv) + (c.causal ? "_causal" : "") +
         (c.input_scale != 1.f ? "_x" + std::to_string(int(c.input_scale)) : "");
}

struct ErrorStats {
  double max_abs = 0;   // max |x - ref|
  double rel_l2 = 0;    // ||x - ref|| / ||ref||
};

ErrorStats error_vs(const std::vector<double>& x, const std::vector<double>& ref) {
  ErrorStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    e.max_abs = std::max(e.max_abs, std::abs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

// How configuration cfg rounds P: its key blocks, walked backwards, and its rescale threshold.
reference::EmulationOptions emulation_options(const fk::KernelConfig& cfg) {
  reference::EmulationOptions options;
  options.block_n = cfg.block_n;
  options.backwards = true;
  options.rescale_threshold_log2 = cfg.rescale_threshold_log2();
  return options;
}

// The emulation's error against fp64 for one set of emulation options.
struct EmulatedError {
  reference::EmulationOptions options;
  ErrorStats out;
  double lse = 0;  // max over rows that see a key
};

// Runs one problem through every compiled configuration and checks each result.
void check_case(DType dtype, int head_dim, const Case& c) {
  std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(case_name(dtype, head_dim, c)));
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t q_elems = size_t(c.batch) * c.seqlen_q * c.heads_q * head_dim;
  const size_t kv_elems = size_t(c.batch) * c.seqlen_k * c.heads_kv * head_dim;
  const size_t lse_elems = size_t(c.batch) * c.heads_q * c.seqlen_q;
  auto random_tensor = [&](size_t n, float scale) {
    std::vector<uint16_t> t(n);
    for (auto& x : t) {
      const float f = normal(rng) * scale;
      x = dtype == DType::kFloat16 ? float_to_half(f) : float_to_bf16(f);
    }
    return t;
  };
  const std::vector<uint16_t> q = random_tensor(q_elems, c.input_scale);
  const std::vector<uint16_t> k = random_tensor(kv_elems, c.input_scale);
  const std::vector<uint16_t> v = random_tensor(kv_elems, 1.f);

  AttentionParams p = make_contiguous_params(dtype, c.batch, c.seqlen_q, c.seqlen_k, c.heads_q,
                                             c.heads_kv, head_dim, c.causal,
                                             1.f / std::sqrt(float(head_dim)));
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  std::vector<double> ref_out, ref_lse;
  reference::attention_fp64(p, &ref_out, &ref_lse);
  const AttentionParams host_p = p;  // p is pointed at the device buffers below
  std::vector<EmulatedError> emulated;  // one per distinct EmulationOptions, computed on demand
  auto emulated_error = [&](const reference::EmulationOptions& options) -> const EmulatedError& {
    for (const EmulatedError& e : emulated)
      if (e.options.block_n == options.block_n && e.options.backwards == options.backwards &&
          e.options.rescale_threshold_log2 == options.rescale_threshold_log2)
        return e;
    std::vector<double> emu_out, emu_lse;
    reference::attention_emulated(host_p, options, &emu_out, &emu_lse);
    EmulatedError e{options, error_vs(emu_out, ref_out), 0};
    for (size_t i = 0; i < ref_lse.size(); ++i)
      if (std::isfinite(ref_lse[i])) e.lse = std::max(e.lse, std::abs(emu_lse[i] - ref_lse[i]));
    emulated.push_back(e);
    return emulated.back();
  };

  DeviceBuffer dq(q_elems * 2), dk(kv_elems * 2), dv(kv_elems * 2), dout(q_elems * 2),
      dlse(lse_elems * 4);
  ASSERT_EQ(cudaMemcpy(dq.ptr, q.data(), q_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.ptr, k.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.ptr, v.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  p.q = dq.ptr;
  p.k = dk.ptr;
  p.v = dv.ptr;
  p.o = dout.ptr;
  p.lse = static_cast<float*>(dlse.ptr);
  ASSERT_EQ(fk::supported(p), "");

  std::vector<fk::KernelConfig> configs = fk::candidates(dtype, head_dim, c.causal);
  ASSERT_GE(configs.size(), 2u);  // 32, 96, 256: the default and the 64-row tile
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_NE(std::find(configs.begin(), configs.end(), fk::select(p, sm_count)), configs.end());

  std::vector<uint16_t> out(q_elems);
  std::vector<float> lse(lse_elems);
  std::vector<double> out_d(q_elems), lse_d(lse_elems);
  for (const fk::KernelConfig& cfg : configs) {
    SCOPED_TRACE("config " + cfg.name());
    const EmulatedError emu = emulated_error(emulation_options(cfg));
    const ErrorStats emu_err = emu.out;
    const double emu_lse_err = emu.lse;
    // Poison: 0xFFFF is NaN in both fp16 and bf16 (and in fp32 for the LSE).
    ASSERT_EQ(cudaMemset(dout.ptr, 0xFF, q_elems * 2), cudaSuccess);
    ASSERT_EQ(cudaMemset(dlse.ptr, 0xFF, lse_elems * 4), cudaSuccess);
    ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(out.data(), dout.ptr, q_elems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), dlse.ptr, lse_elems * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    size_t bad = 0;
    for (size_t i = 0; i < q_elems; ++i) {
      out_d[i] = dtype == DType::kFloat16 ? half_to_float(out[i]) : bf16_to_float(out[i]);
      if (!std::isfinite(out_d[i])) ++bad;
    }
    ASSERT_EQ(bad, 0u) << "NaN/Inf (or unwritten) output elements";
    double lse_excess = 0;  // max over rows of (error - allowed error)
    for (size_t i = 0; i < lse_elems; ++i) {
      lse_d[i] = lse[i];
      if (std::isinf(ref_lse[i])) {
        ASSERT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i << " sees no key: LSE must be -inf, got " << lse[i];
      } else {
        ASSERT_TRUE(std::isfinite(lse[i])) << "LSE row " << i << " = " << lse[i];
        // fp32 LSE: 2x the emulation's worst error, plus the approximate exp2 (2 ulp) and the
        // tensor cores' fp32 accumulation (not rounded per step: relative error ~ 2^-22 of the
        // logit, seen as 3.4e-4 at LSE ~ 200 with 8x-scaled inputs).
        const double allowed = 2 * emu_lse_err + 1e-4 + 4e-6 * std::abs(ref_lse[i]);
        lse_excess = std::max(lse_excess, std::abs(lse_d[i] - ref_lse[i]) - allowed);
      }
    }
    const ErrorStats err = error_vs(out_d, ref_out);
    // Floors: one part in 1e6 guards cases where the emulation is exact (e.g. one key).
    EXPECT_LE(err.max_abs, 2 * emu_err.max_abs + 1e-6)
        << "max abs error " << err.max_abs << " vs emulated " << emu_err.max_abs;
    EXPECT_LE(err.rel_l2, 2 * emu_err.rel_l2 + 1e-6)
        << "relative L2 error " << err.rel_l2 << " vs emulated " << emu_err.rel_l2;
    EXPECT_LE(lse_excess, 0.0) << "LSE error exceeds its allowance by " << lse_excess
                               << " (emulated error " << emu_lse_err << ")";
  }
}

struct Param {
  DType dtype;
  int head_dim;
  Case c;
};

std::vector<Param> all_params() {
  std::vector<Case> cases;
  for (int s : {1, 17, 63, 64, 65, 127})
    for (bool causal : {false, true}) cases.push_back({1, s, s, 3, 3, causal, 1.f});
  for (int s : {1000, 1025})
    for (bool causal : {false, true}) cases.push_back({1, s, s, 1, 1, causal, 1.f});
  cases.push_back({1, 4099, 4099, 1, 1, true, 1.f});
  cases.push_back({1, 4099, 4099, 1, 1, false, 1.f});
  cases.push_back({2, 130, 130, 16, 16, false, 1.f});             // heads 16
  cases.push_back({1, 257, 257, 32, 8, true, 1.f});               // GQA 32:8
  cases.push_back({2, 97, 300, 8, 1, false, 1.f});                // MQA 8:1, Sq < Sk
  cases.push_back({1, 65, 1025, 3, 3, true, 1.f});                // causal Sq < Sk
  cases.push_back({1, 1025, 65, 3, 3, true, 1.f});                // causal Sq > Sk: rows see no key
  cases.push_back({1, 200, 17, 2, 1, true, 1.f});                 // causal Sq > Sk, short
  cases.push_back({5, 63, 130, 3, 1, true, 1.f});                 // batch 5
  cases.push_back({5, 17, 17, 1, 1, false, 1.f});
  cases.push_back({1, 1, 4099, 3, 3, false, 1.f});                // decode-like
  cases.push_back({1, 1, 4099, 3, 3, true, 1.f});
  cases.push_back({1, 127, 1025, 3, 3, false, 8.f});              // large logits
  cases.push_back({2, 333, 333, 2, 1, true, 8.f});
  std::vector<Param> params;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    for (int hd : {32, 64, 96, 128, 256})  // head dims not compiled in this build skip
      for (const Case& c : cases) params.push_back({dtype, hd, c});
  return params;
}

class CudaAttention : public ::testing::TestWithParam<Param> {};

TEST_P(CudaAttention, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const Param& prm = GetParam();
  const std::vector<int> dims = fk::supported_head_dims();
  if (std::find(dims.begin(), dims.end(), prm.head_dim) == dims.end())
    GTEST_SKIP() << "head_dim " << prm.head_dim << " not compiled in this build";
  check_case(prm.dtype, prm.head_dim, prm.c);
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaAttention, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& param_info) {
                           return case_name(param_info.param.dtype, param_info.param.head_dim, param_info.param.c);
                         });

// Strided (non-contiguous) views: q/k/v/o inside larger packed buffers, as a server batching
// requests would pass them.
TEST(CudaAttentionLayout, PaddedStrides) {
  SKIP_WITHOUT_GPU();
  const int b = 2, s = 77, hq = 4, hkv = 2, d = 64;
  AttentionParams p = make_contiguous_params(DType::kBFloat16, b, s, s, hq, hkv, d, true, 0.11f);
  // Pad every row by 8 heads' worth of elements and every batch by 3 rows.
  p.q_row_stride = p.o_row_stride = int64_t(hq + 8) * d;
  p.q_batch_stride = p.o_batch_stride = p.q_row_stride * (s + 3);
  p.k_row_stride = p.v_row_stride = int64_t(hkv + 8) * d;
  p.k_batch_stride = p.v_batch_stride = p.k_row_stride * (s + 3);
  const size_t q_elems = size_t(p.q_batch_stride) * b, kv_elems = size_t(p.k_batch_stride) * b;
  std::mt19937_64 rng(fresh_seed());
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> q(q_elems), k(kv_elems), v(kv_elems);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = float_to_bf16(normal(rng));
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const fk::KernelConfig cfg = fk::select(p, sm_count);  // what run(p, stream) uses
  std::vector<double> ref_out, ref_lse, emu_out, emu_lse;
  reference::attention_fp64(p, &ref_out, &ref_lse);
  reference::attention_emulated(p, emulation_options(cfg), &emu_out, &emu_lse);
  DeviceBuffer dq(q_elems * 2), dk(kv_elems * 2), dv(kv_elems * 2), dout(q_elems * 2);
  ASSERT_EQ(cudaMemcpy(dq.ptr, q.data(), q_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.ptr, k.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.ptr, v.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout.ptr, 0xFF, q_elems * 2), cudaSuccess);
  p.q = dq.ptr;
  p.k = dk.ptr;
  p.v = dv.ptr;
  p.o = dout.ptr;
  ASSERT_EQ(fk::run(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(q_elems);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.ptr, q_elems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> got(ref_out.size());
  for (int bi = 0; bi < b; ++bi)
    for (int i = 0; i < s; ++i)
      for (int h = 0; h < hq; ++h)
        for (int c = 0; c < d; ++c)
          got[((size_t(bi) * s + i) * hq + h) * d + c] =
              bf16_to_float(out[bi * p.o_batch_stride + i * p.o_row_stride + h * d + c]);
  const ErrorStats err = error_vs(got, ref_out), emu = error_vs(emu_out, ref_out);
  EXPECT_LE(err.max_abs, 2 * emu.max_abs + 1e-6);
  EXPECT_LE(err.rel_l2, 2 * emu.rel_l2 + 1e-6);
}

TEST(CudaAttentionApi, RunRejectsUnsupported) {
  SKIP_WITHOUT_GPU();
  AttentionParams p = make_contiguous_params(DType::kBFloat16, 1, 16, 16, 2, 2, 48, false, 0.1f);
  EXPECT_EQ(fk::run(p, nullptr), cudaErrorInvalidValue);
  p = make_contiguous_params(DType::kBFloat16, 1, 16, 16, 2, 2, 64, false, 0.1f);
  EXPECT_EQ(fk::run(p, fk::KernelConfig{96, 48, 3, 1, false}, nullptr), cudaErrorInvalidValue);
}

// The checks below touch no GPU and run everywhere.
TEST(CudaAttentionApi, SupportedNamesTheField) {
  AttentionParams p = make_contiguous_params(DType::kBFloat16, 1, 16, 16, 2, 2, 48, false, 0.1f);
  EXPECT_NE(fk::supported(p).find("head_dim 48 is not supported by the CUDA kernels"), std::string::npos)
      << fk::supported(p);
  p = make_contiguous_params(DType::kFloat32, 1, 16, 16, 2, 2, 64, false, 0.1f);
  EXPECT_NE(fk::supported(p).find("dtype float32"), std::string::npos) << fk::supported(p);
  p = make_contiguous_params(fk::supported_dtypes().front(), 1, 16, 16, 6, 4,
                             fk::supported_head_dims().front(), false, 0.1f);
  EXPECT_NE(fk::supported(p).find("heads_kv"), std::string::npos) << fk::supported(p);
}

TEST(CudaAttentionApi, ConfigNamesRoundTrip) {
  for (DType dtype : fk::supported_dtypes())
    for (int hd : fk::supported_head_dims())
      for (bool causal : {false, true}) {
        const auto configs = fk::candidates(dtype, hd, causal);
        EXPECT_GE(configs.size(), 2u);
        // select()'s two sm80 choices (default and 64-row tile) are compiled for every dim.
        EXPECT_NE(std::find(configs.begin(), configs.end(), fk::KernelConfig{64, 64, 4, 2, false}),
                  configs.end()) << hd;
        for (const auto& cfg : configs) {
          const auto parsed = fk::KernelConfig::parse(cfg.name());
          ASSERT_TRUE(parsed.has_value()) << cfg.name();
          EXPECT_EQ(*parsed, cfg);
        }
      }
  EXPECT_FALSE(fk::KernelConfig::parse("m128n64").has_value());
  EXPECT_FALSE(fk::KernelConfig::parse("m128n64w4s2qx").has_value());
  // The lazy-rescale suffix: after q, at most once; names without it keep their meaning.
  const auto lazy = fk::KernelConfig::parse("m128n64w4s2l");
  ASSERT_TRUE(lazy.has_value());
  EXPECT_TRUE(lazy->lazy_rescale);
  EXPECT_FALSE(lazy->q_in_regs);
  EXPECT_EQ(lazy->name(), "m128n64w4s2l");
  const auto both = fk::KernelConfig::parse("m128n64w8s2ql");
  ASSERT_TRUE(both.has_value());
  EXPECT_TRUE(both->q_in_regs && both->lazy_rescale);
  EXPECT_FALSE(fk::KernelConfig::parse("m128n64w4s2").value().lazy_rescale);
  EXPECT_NE(*fk::KernelConfig::parse("m128n64w4s2"), *lazy);
  EXPECT_FALSE(fk::KernelConfig::parse("m128n64w4s2lq").has_value());
  EXPECT_FALSE(fk::KernelConfig::parse("m128n64w4s2ll").has_value());
}

}  // namespace
}  // namespace flashserve::kernels
