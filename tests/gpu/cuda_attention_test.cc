// Correctness of the CUDA forward kernels against fp64 and dtype-emulating CPU references,
// on fresh random inputs, over odd sizes, GQA, causal with seqlen_q != seqlen_k, LSE, and every
// compiled configuration. Tolerance: the kernel's error against fp64 may be at most twice the
// error of reference::attention_emulated with that configuration's emulation options (which
// round inputs and P like the kernel: its key blocks, their order, its rescale threshold).
#include "flashserve/kernels/cuda_attention.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "gpu_test_support.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

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

// Runs cfg on the (poisoned) device problem and checks O and the LSE against the references.
void check_config(const AttentionParams& host_p, tu::DeviceProblem& dev,
                  const fk::KernelConfig& cfg, tu::Fp64Reference& ref) {
  SCOPED_TRACE("config " + cfg.name());
  const tu::EmulatedError& emu = ref.emulated(cfg);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(dev.params(host_p, true), cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(host_p));
  std::vector<float> lse(tu::lse_elements(host_p));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  ASSERT_EQ(dev.lse.download(&lse), cudaSuccess);
  const std::vector<double> out_d = tu::to_double(host_p.dtype, out);
  ASSERT_TRUE(tu::all_finite(out_d));
  EXPECT_TRUE(tu::lse_matches(lse, ref.lse(), emu.lse));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(out_d, ref.out()), emu.out));
}

// Runs one problem through every compiled configuration and checks each result.
void check_case(DType dtype, int head_dim, const Case& c) {
  std::mt19937_64 rng(tu::case_seed(case_name(dtype, head_dim, c)));
  AttentionParams host_p =
      make_contiguous_params(dtype, c.batch, c.seqlen_q, c.seqlen_k, c.heads_q, c.heads_kv,
                             head_dim, c.causal, 1.f / std::sqrt(float(head_dim)));
  const tu::HostQkv qkv = tu::random_qkv(&host_p, c.input_scale, rng);
  tu::Fp64Reference ref(host_p);
  tu::DeviceProblem dev(host_p);
  ASSERT_EQ(dev.upload(host_p), cudaSuccess);
  const AttentionParams p = dev.params(host_p, true);
  ASSERT_EQ(fk::supported(p), "");

  const std::vector<fk::KernelConfig> configs = fk::candidates(dtype, head_dim, c.causal);
  ASSERT_GE(configs.size(), 2u);  // 32, 96, 256: the default and the 64-row tile
  int sm_count = 0;
  ASSERT_EQ(tu::multiprocessor_count(&sm_count), cudaSuccess);
  EXPECT_NE(std::find(configs.begin(), configs.end(), fk::select(p, sm_count)), configs.end());
  for (const fk::KernelConfig& cfg : configs) {
    ASSERT_NO_FATAL_FAILURE(check_config(host_p, dev, cfg, ref));
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

// One run of cfg on host_p's shape with the Q/K/V of qkv; O in [row, head, d] order.
void run_on(const AttentionParams& host_p, const tu::HostQkv& qkv, const fk::KernelConfig& cfg,
            tu::RunAnswers* answers) {
  AttentionParams hp = host_p;
  hp.q = qkv.q.data(), hp.k = qkv.k.data(), hp.v = qkv.v.data();
  tu::DeviceProblem dev(hp);
  ASSERT_EQ(dev.upload(hp), cudaSuccess);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(dev.params(hp, true), cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(hp));
  answers->lse.resize(tu::lse_elements(hp));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  ASSERT_EQ(dev.lse.download(&answers->lse), cudaSuccess);
  answers->out = tu::gather_output(hp, out);
}

// A NaN input makes NaN exactly the rows that read it, in O and in the LSE, in every compiled
// configuration (sm80 and, on sm_90, sm90), as the CPU backend and the Python reference do: a NaN
// row's LSE used to come back -inf ("saw no key"), which an LSE-weighted merge drops silently.
// Batch 0: one K element NaN in KV head 1 at key 200 (q heads 4..7 read it; causal bottom-right:
// rows 30..129); batch 1: q row 5 of head 2 NaN.
TEST(CudaAttentionNaN, PoisonsOnlyTheRowsThatReadIt) {
  SKIP_WITHOUT_GPU();
  const DType dtype = DType::kBFloat16;
  const int d = 128, batch = 2, sq = 130, sk = 300, hq = 8, hkv = 2, key = 200, q_row = 5;
  if (!tu::compiled(dtype, d)) GTEST_SKIP() << "bf16 d128 not compiled in this build";
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    std::mt19937_64 rng(tu::case_seed(std::string("nan_rows_") + (causal ? "causal" : "full")));
    AttentionParams host_p =
        make_contiguous_params(dtype, batch, sq, sk, hq, hkv, d, causal, 1.f / std::sqrt(float(d)));
    const tu::HostQkv clean_qkv = tu::random_qkv(&host_p, 1.f, rng);
    tu::HostQkv bad_qkv = clean_qkv;
    bad_qkv.k[((size_t(0) * sk + key) * hkv + 1) * d + 3] = 0x7FC0;  // bf16 NaN
    bad_qkv.q[((size_t(1) * sq + q_row) * hq + 2) * d + 9] = 0x7FC0;
    const auto lse_at = [&](int row, int h) { return (size_t(row / sq) * hq + h) * sq + row % sq; };
    const auto read_nan = [&](int row, int h) {
      const int b = row / sq, i = row % sq;
      if (b == 1) return h == 2 && i == q_row;
      return h / (hq / hkv) == 1 && (!causal || key <= i + (sk - sq));
    };
    for (const fk::KernelConfig& cfg : fk::candidates(dtype, d, causal)) {
      SCOPED_TRACE("config " + cfg.name());
      tu::RunAnswers clean, got;
      ASSERT_NO_FATAL_FAILURE(run_on(host_p, clean_qkv, cfg, &clean));
      ASSERT_NO_FATAL_FAILURE(run_on(host_p, bad_qkv, cfg, &got));
      ASSERT_TRUE(tu::all_finite(clean.out));
      EXPECT_TRUE(tu::nan_only_where_read(clean, got, batch * sq, hq, d, lse_at, read_nan));
    }
  }
}

// bf16 bits of 2^e (exact for -126 <= e <= 127).
uint16_t bf16_pow2(int e) { return uint16_t((e + 127) << 7); }
// fp16 bits of 2^e (exact for -14 <= e <= 15).
uint16_t fp16_pow2(int e) { return uint16_t((e + 15) << 10); }

// Sets every element of key `key` of KV head `h` (batch-major [b, s, h, d]) to `bits`.
void fill_k_row(const AttentionParams& p, tu::HostQkv* qkv, int b, int key, int h, uint16_t bits) {
  const size_t at = ((size_t(b) * p.seqlen_k + key) * p.heads_kv + h) * p.head_dim;
  std::fill(qkv->k.begin() + long(at), qkv->k.begin() + long(at + p.head_dim), bits);
}

// Sets every element of q row `row` of head `h` (batch-major [b, s, h, d]) to `bits`.
void fill_q_row(const AttentionParams& p, tu::HostQkv* qkv, int b, int row, int h, uint16_t bits) {
  const size_t at = ((size_t(b) * p.seqlen_q + row) * p.heads_q + h) * p.head_dim;
  std::fill(qkv->q.begin() + long(at), qkv->q.begin() + long(at + p.head_dim), bits);
}

// The fp64 softmax of one q row over the keys it sees: its largest scaled logit (log2 units,
// the kernels' M), its O and its LSE.
struct RowTruth {
  double max_log2 = 0, lse = 0;
  std::vector<double> out;
};
RowTruth row_truth(const AttentionParams& p, const tu::HostQkv& qkv, int b, int row, int h) {
  const int d = p.head_dim, kh = h / (p.heads_q / p.heads_kv);
  const int last =
      p.causal ? std::min(p.seqlen_k - 1, row + p.seqlen_k - p.seqlen_q) : p.seqlen_k - 1;
  std::vector<double> logit(size_t(last) + 1);
  for (int j = 0; j <= last; ++j) {
    double dot = 0;
    for (int c = 0; c < d; ++c)
      dot +=
          tu::to_double(p.dtype, qkv.q[((size_t(b) * p.seqlen_q + row) * p.heads_q + h) * d + c]) *
          tu::to_double(p.dtype, qkv.k[((size_t(b) * p.seqlen_k + j) * p.heads_kv + kh) * d + c]);
    logit[size_t(j)] = dot * p.softmax_scale;
  }
  const double mx = *std::max_element(logit.begin(), logit.end());
  RowTruth t;
  t.max_log2 = mx * 1.4426950408889634;
  t.out.assign(size_t(d), 0.0);
  double sum = 0;
  for (int j = 0; j <= last; ++j) {
    const double w = std::exp(logit[size_t(j)] - mx);
    sum += w;
    for (int c = 0; c < d; ++c)
      t.out[size_t(c)] +=
          w *
          tu::to_double(p.dtype, qkv.v[((size_t(b) * p.seqlen_k + j) * p.heads_kv + kh) * d + c]);
  }
  for (double& o : t.out) o /= sum;
  t.lse = mx + std::log(sum);
  return t;
}

// A q row (batch b, row, head h) of the range tests, its elements 2^log2_q.
struct BigRow {
  int b, row, h, log2_q;
};

// Every compiled config on `clean_qkv` and on `big_qkv` (which adds the rows `past` to it): the
// rows past the range NaN in O and LSE and every other row as on the clean inputs; `within` (a row
// of large logits in range, in both) against its fp64 softmax `truth`.
void expect_range_rows(const AttentionParams& host_p, const tu::HostQkv& clean_qkv,
                       const tu::HostQkv& big_qkv, const std::vector<BigRow>& past,
                       const BigRow& within, const RowTruth& truth) {
  const int sq = host_p.seqlen_q, hq = host_p.heads_q, d = host_p.head_dim;
  const auto lse_at = [&](int row, int h) { return (size_t(row / sq) * hq + h) * sq + row % sq; };
  const auto past_limit = [&](int row, int h) {
    return std::any_of(past.begin(), past.end(), [&](const BigRow& r) {
      return r.b == row / sq && r.row == row % sq && r.h == h;
    });
  };
  for (const fk::KernelConfig& cfg : fk::candidates(host_p.dtype, d, host_p.causal)) {
    SCOPED_TRACE("config " + cfg.name());
    tu::RunAnswers clean, got;
    ASSERT_NO_FATAL_FAILURE(run_on(host_p, clean_qkv, cfg, &clean));
    ASSERT_NO_FATAL_FAILURE(run_on(host_p, big_qkv, cfg, &got));
    ASSERT_TRUE(tu::all_finite(clean.out));
    EXPECT_TRUE(tu::nan_only_where_read(clean, got, host_p.batch * sq, hq, d, lse_at, past_limit));
    const size_t at = ((size_t(within.b) * sq + within.row) * hq + within.h) * d;
    double err = 0, v_max = 0;
    for (int c = 0; c < d; ++c) {
      err = std::max(err, std::abs(clean.out[at + size_t(c)] - truth.out[size_t(c)]));
      v_max = std::max(v_max, std::abs(truth.out[size_t(c)]));
    }
    EXPECT_LE(err, 0.01 * std::max(v_max, 1.0)) << "a row of large logits within range";
    const float lse = clean.lse[lse_at(within.b * sq + within.row, within.h)];
    EXPECT_NEAR(lse, truth.lse, 1e-4 * std::abs(truth.lse));  // fp32 q.k of ~2^30
  }
}

// Logits whose scale the prefill kernels' exp2 form cannot hold: P = 2^(fma(s, scale_log2, -M))
// carries M's rounding (up to ulp(M) / 2) into every exponent, so from |M| = 2^31 on (M in log2
// units) P could overflow or the max key's own P underflow to 0 -- a row of zeros and LSE -inf,
// "saw no key", on finite inputs. Such rows are NaN now, in every config and nowhere else; a row
// of large logits below the limit is still computed (against fp64). bf16 q rows of 2^31..2^60
// over N(0, 1) keys give |M| of 2^33 and more.
TEST(CudaAttentionRange, LogitsPastTheExp2FormsRangeAreNaNOnlyInTheirRows) {
  SKIP_WITHOUT_GPU();
  const DType dtype = DType::kBFloat16;
  const int d = 128, batch = 2, sq = 130, sk = 300, hq = 8, hkv = 2;
  if (!tu::compiled(dtype, d)) GTEST_SKIP() << "bf16 d128 not compiled in this build";
  const std::vector<BigRow> past = {{0, 5, 0, 34},  {0, 77, 6, 40},  {1, 9, 5, 31},
                                    {1, 64, 2, 45}, {1, 129, 7, 60}, {0, 120, 1, 33}};
  const BigRow within{0, 100, 3, 24};  // |M| about 2^26: computed
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    std::mt19937_64 rng(tu::case_seed(std::string("range_rows_") + (causal ? "causal" : "full")));
    AttentionParams host_p =
        make_contiguous_params(dtype, batch, sq, sk, hq, hkv, d, causal, 1.f / std::sqrt(float(d)));
    tu::HostQkv clean_qkv = tu::random_qkv(&host_p, 1.f, rng);
    fill_q_row(host_p, &clean_qkv, within.b, within.row, within.h, bf16_pow2(within.log2_q));
    tu::HostQkv big_qkv = clean_qkv;
    for (const BigRow& r : past) {
      fill_q_row(host_p, &big_qkv, r.b, r.row, r.h, bf16_pow2(r.log2_q));
      ASSERT_GE(std::abs(row_truth(host_p, big_qkv, r.b, r.row, r.h).max_log2), 4294967296.0)
          << "row " << r.row << ": its logits stay in range, the case tests nothing";
    }
    const RowTruth truth = row_truth(host_p, clean_qkv, within.b, within.row, within.h);
    ASSERT_LT(std::abs(truth.max_log2), 1073741824.0);
    expect_range_rows(host_p, clean_qkv, big_qkv, past, within, truth);
  }
}

// fp16: P is rounded to fp16 for P*V, which ends at 65504 and is 0 below 2^-24, so M's rounding
// breaks it sooner: from 2^29 an audit's emulation rounded the max key's P to 0 (O = 0, LSE finite)
// or inf. Rows from |M| = 2^27 on are NaN. fp16 inputs reach such logits only through large q and
// k together: key 150 of KV head 0 is 2^12 in every element (in the clean inputs too); q rows of
// 2^12 against it give |M| ~ 2^28 (NaN), a row of 2^10 ~ 2^26 (computed, against fp64).
TEST(CudaAttentionRange, Fp16RowsPast2To27AreNaNOnlyInTheirRows) {
  SKIP_WITHOUT_GPU();
  const DType dtype = DType::kFloat16;
  const int d = 128, batch = 2, sq = 130, sk = 300, hq = 8, hkv = 2, big_key = 150;
  if (!tu::compiled(dtype, d)) GTEST_SKIP() << "fp16 d128 not compiled in this build";
  const std::vector<BigRow> past = {{0, 5, 0, 12}, {0, 77, 3, 12}, {1, 9, 1, 12}, {1, 129, 2, 12}};
  const BigRow within{0, 100, 2, 10};  // q heads 0..3 read KV head 0
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    std::mt19937_64 rng(tu::case_seed(std::string("fp16_range_") + (causal ? "causal" : "full")));
    AttentionParams host_p =
        make_contiguous_params(dtype, batch, sq, sk, hq, hkv, d, causal, 1.f / std::sqrt(float(d)));
    tu::HostQkv clean_qkv = tu::random_qkv(&host_p, 1.f, rng);
    for (int b = 0; b < batch; ++b) fill_k_row(host_p, &clean_qkv, b, big_key, 0, fp16_pow2(12));
    fill_q_row(host_p, &clean_qkv, within.b, within.row, within.h, fp16_pow2(within.log2_q));
    tu::HostQkv big_qkv = clean_qkv;
    for (const BigRow& r : past) {
      fill_q_row(host_p, &big_qkv, r.b, r.row, r.h, fp16_pow2(r.log2_q));
      ASSERT_GE(std::abs(row_truth(host_p, big_qkv, r.b, r.row, r.h).max_log2), 268435456.0)
          << "row " << r.row << ": its logits stay in range, the case tests nothing";
    }
    const RowTruth truth = row_truth(host_p, clean_qkv, within.b, within.row, within.h);
    ASSERT_LT(std::abs(truth.max_log2), 100663296.0);  // 0.75 x 2^27
    expect_range_rows(host_p, clean_qkv, big_qkv, past, within, truth);
  }
}

// Strided (non-contiguous) views: q/k/v/o inside larger packed buffers, as a server batching
// requests would pass them.
TEST(CudaAttentionLayout, PaddedStrides) {
  SKIP_WITHOUT_GPU();
  const int b = 2, s = 77, hq = 4, hkv = 2, d = 64;
  AttentionParams host_p =
      make_contiguous_params(DType::kBFloat16, b, s, s, hq, hkv, d, true, 0.11f);
  tu::pad_strides(&host_p, 8, 3);  // 8 heads' worth of elements per row, 3 rows per batch
  std::mt19937_64 rng(tu::case_seed("PaddedStrides"));
  const tu::HostQkv qkv = tu::random_qkv(&host_p, 1.f, rng);
  int sm_count = 0;
  ASSERT_EQ(tu::multiprocessor_count(&sm_count), cudaSuccess);
  const fk::KernelConfig cfg = fk::select(host_p, sm_count);  // what run(p, stream) uses
  tu::Fp64Reference ref(host_p);
  tu::DeviceProblem dev(host_p);
  ASSERT_EQ(dev.upload(host_p), cudaSuccess);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(dev.params(host_p, false), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(host_p));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  const std::vector<double> got = tu::gather_output(host_p, out);
  ASSERT_TRUE(tu::all_finite(got));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(got, ref.out()), ref.emulated(cfg).out));
}

// Whether O is all poison still: nothing wrote it.
bool o_still_poisoned(const AttentionParams& host_p, const tu::DeviceProblem& dev) {
  std::vector<uint16_t> out(tu::q_elements(host_p));
  if (dev.o.download(&out) != cudaSuccess) return false;
  const std::vector<double> got = tu::to_double(host_p.dtype, out);
  return std::all_of(got.begin(), got.end(), [](double x) { return std::isnan(x); });
}

// Disagreeing scales (O came out at the log2 field's 0.125, the LSE at neither) are refused
// before any launch (supported() asked first: a build without the check stops there rather
// than launch); with both at 0.5 the problem matches the references.
TEST(CudaAttentionApi, DisagreeingScalesAreRefusedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  AttentionParams host_p =
      make_contiguous_params(DType::kBFloat16, 1, 64, 256, 4, 4, 64, false, 0.5f);
  std::mt19937_64 rng(tu::case_seed("DisagreeingScales"));
  const tu::HostQkv qkv = tu::random_qkv(&host_p, 1.f, rng);
  tu::Fp64Reference ref(host_p);
  tu::DeviceProblem dev(host_p);
  ASSERT_EQ(dev.upload(host_p), cudaSuccess);
  AttentionParams p = dev.params(host_p, true);
  p.softmax_scale_log2 = 0.125f * 1.4426950408889634f;
  ASSERT_NE(fk::supported(p).find("softmax_scale_log2"), std::string::npos) << fk::supported(p);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  EXPECT_EQ(fk::run(p, nullptr), cudaErrorInvalidValue);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(o_still_poisoned(host_p, dev));
  int sm_count = 0;
  ASSERT_EQ(tu::multiprocessor_count(&sm_count), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(check_config(host_p, dev, fk::select(host_p, sm_count), ref));
}

// Two packed sequences of 64 query rows and 96 keys: the bytes of the dense [2, 64, heads, d]
// problem, whose references apply. seqlen_q 63 (row 63 went uncomputed) or 0 (nothing computed,
// success returned) is refused before any launch; seqlen_q 64 computes the dense answer.
TEST(CudaAttentionApi, VarlenSeqlenQBelowItsRowsIsRefusedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  AttentionParams host_p =
      make_contiguous_params(DType::kBFloat16, 2, 64, 96, 4, 2, 64, true, 0.125f);
  std::mt19937_64 rng(tu::case_seed("VarlenSeqlenQBelowItsRows"));
  const tu::HostQkv qkv = tu::random_qkv(&host_p, 1.f, rng);
  tu::Fp64Reference ref(host_p);
  tu::DeviceProblem dev(host_p);
  ASSERT_EQ(dev.upload(host_p), cudaSuccess);
  tu::DeviceBuffer cu_q(3 * sizeof(int)), cu_k(3 * sizeof(int));
  ASSERT_EQ(cu_q.upload(std::vector<int>{0, 64, 128}), cudaSuccess);
  ASSERT_EQ(cu_k.upload(std::vector<int>{0, 96, 192}), cudaSuccess);
  AttentionParams p = dev.params(host_p, false);  // varlen LSE is [heads_q, total_q]: O only
  p.cu_seqlens_q = cu_q.as<const int>();
  p.cu_seqlens_k = cu_k.as<const int>();
  p.total_q = 128;
  p.total_k = 192;
  for (int seqlen_q : {63, 0}) {
    SCOPED_TRACE("seqlen_q " + std::to_string(seqlen_q));
    AttentionParams bad = p;
    bad.seqlen_q = seqlen_q;
    ASSERT_NE(fk::supported(bad).find("seqlen_q"), std::string::npos) << fk::supported(bad);
    ASSERT_EQ(dev.poison(), cudaSuccess);
    EXPECT_EQ(fk::run(bad, nullptr), cudaErrorInvalidValue);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(o_still_poisoned(host_p, dev));
  }
  int sm_count = 0;
  ASSERT_EQ(tu::multiprocessor_count(&sm_count), cudaSuccess);
  const fk::KernelConfig cfg = fk::select(p, sm_count);  // what run(p, stream) uses
  ASSERT_EQ(dev.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(host_p));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  const std::vector<double> got = tu::to_double(host_p.dtype, out);
  ASSERT_TRUE(tu::all_finite(got));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(got, ref.out()), ref.emulated(cfg).out));
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

// A problem with aligned dummy pointers, for the checks that touch no GPU.
AttentionParams with_dummy_ptrs(AttentionParams p) {
  alignas(16) static const char kData[16] = {};
  p.q = p.k = p.v = kData;
  p.o = const_cast<char*>(kData);
  return p;
}

// softmax_scale_log2 must be softmax_scale * log2(e) to float rounding: the kernels exponentiate
// with it but form the LSE with softmax_scale (the CPU backend uses only that one).
TEST(CudaAttentionApi, SupportedRefusesScalesThatDisagree) {
  const DType dtype = fk::supported_dtypes().front();
  const int d = fk::supported_head_dims().front();
  AttentionParams p =
      with_dummy_ptrs(make_contiguous_params(dtype, 1, 16, 16, 2, 2, d, false, 0.125f));
  EXPECT_EQ(fk::supported(p), "");
  p.softmax_scale_log2 *= 1.f + 4e-6f;  // another derivation's rounding
  EXPECT_EQ(fk::supported(p), "");
  p.softmax_scale_log2 = 0.125f * 1.4426950408889634f * (1.f + 1e-4f);
  EXPECT_NE(fk::supported(p).find("softmax_scale_log2"), std::string::npos) << fk::supported(p);
  p = with_dummy_ptrs(make_contiguous_params(dtype, 1, 16, 16, 2, 2, d, false, 0.125f));
  p.softmax_scale = 0.5f;  // set after make_contiguous_params: the log2 field still 0.125's
  EXPECT_NE(fk::supported(p).find("softmax_scale_log2"), std::string::npos) << fk::supported(p);
  // make_contiguous_params' own pair passes, also for a subnormal scale (coarsely rounded).
  p = with_dummy_ptrs(make_contiguous_params(dtype, 1, 16, 16, 2, 2, d, false, 1e-40f));
  EXPECT_EQ(fk::supported(p), "");
}

// Packed variable lengths: seqlen_q sizes the grid, so with total_q set it must bound every
// sequence (>= 1, batch * seqlen_q >= total_q); rows past a smaller bound went uncomputed.
TEST(CudaAttentionApi, VarlenNeedsASeqlenQThatBoundsEverySequence) {
  static const int kCu[4] = {0, 3, 5, 9};  // host memory: supported() reads no offset
  AttentionParams p =
      with_dummy_ptrs(make_contiguous_params(fk::supported_dtypes().front(), 3, 3, 4, 2, 2,
                                             fk::supported_head_dims().front(), false, 0.1f));
  p.cu_seqlens_q = p.cu_seqlens_k = kCu;
  p.total_q = 9;
  EXPECT_EQ(fk::supported(p), "");  // 3 x 3 == 9
  for (int seqlen_q : {2, 0}) {     // 9 rows in 3 sequences of <= 2; no bound at all
    p.seqlen_q = seqlen_q;
    EXPECT_NE(fk::supported(p).find("seqlen_q"), std::string::npos)
        << seqlen_q << ": " << fk::supported(p);
  }
}

// runnable() is run()'s own checks: packed inputs without total_k run only on the configuration
// with a varlen kernel (select()'s), and run() refuses the others before any launch.
TEST(CudaAttentionApi, RunnableIsWhatRunAccepts) {
  static const int kCu[4] = {0, 3, 5, 9};
  AttentionParams p =
      with_dummy_ptrs(make_contiguous_params(fk::supported_dtypes().front(), 3, 4, 4, 2, 2,
                                             fk::supported_head_dims().front(), false, 0.1f));
  p.cu_seqlens_q = p.cu_seqlens_k = kCu;
  p.total_q = 9;
  const fk::KernelConfig chosen = fk::select(p, 132);
  EXPECT_TRUE(fk::runnable(p, chosen)) << chosen.name();
  int refused = 0;
  for (const fk::KernelConfig& cfg : fk::candidates(p.dtype, p.head_dim, false)) {
    if (fk::runnable(p, cfg)) continue;
    ++refused;
    EXPECT_EQ(fk::run(p, cfg, nullptr), cudaErrorInvalidValue) << cfg.name();
  }
  EXPECT_GE(refused, 1);  // the 64-row tile, compiled for every head dim, has no varlen kernel
  EXPECT_FALSE(fk::runnable(p, fk::KernelConfig{96, 48, 3, 1, false}));  // not compiled
  p.softmax_scale *= 2;  // supported(p) fails: no configuration runs it
  EXPECT_FALSE(fk::runnable(p, chosen));
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
