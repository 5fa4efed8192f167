// The kernel-side autotuner (flashserve/kernels/tuner.h): on a small grid it returns a best
// candidate that is the fastest ok one and computes the right answer (against the fp64
// reference, tolerance 2x the dtype-emulating reference's error); it refuses unsupported
// problems and leaks no device memory.
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
#include "flashserve/kernels/tuner.h"
#include "gpu_test_support.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

using testing_util::compiled;

// Runs cfg on fresh random inputs (seeded by name) and checks it against the fp64 reference.
void expect_correct(const AttentionParams& shape, const fk::KernelConfig& cfg,
                    const std::string& name) {
  SCOPED_TRACE("config " + cfg.name() + ", " + name);
  std::mt19937_64 rng(tu::case_seed(name));
  AttentionParams host_p = shape;
  const tu::HostQkv qkv = tu::random_qkv(&host_p, 1.f, rng);
  tu::Fp64Reference ref(host_p);
  tu::DeviceProblem dev(host_p);
  ASSERT_EQ(dev.upload(host_p), cudaSuccess);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(dev.params(host_p, false), cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(host_p));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  const std::vector<double> out_d = tu::to_double(host_p.dtype, out);
  ASSERT_TRUE(tu::all_finite(out_d));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(out_d, ref.out()), ref.emulated(cfg).out));
}

size_t free_device_memory() {
  size_t free_bytes = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  return free_bytes;
}

struct GridPoint {
  int head_dim;
  bool causal;
  int seqlen;
};

std::string point_name(const GridPoint& g) {
  return "bf16_d" + std::to_string(g.head_dim) + "_s" + std::to_string(g.seqlen) +
         (g.causal ? "_causal" : "");
}

class TunerGrid : public ::testing::TestWithParam<GridPoint> {};

TEST_P(TunerGrid, BestIsFastestOkAndCorrect) {
  SKIP_WITHOUT_GPU();
  const GridPoint g = GetParam();
  if (!compiled(DType::kBFloat16, g.head_dim))
    GTEST_SKIP() << "bf16 head_dim " << g.head_dim << " not compiled in this build";
  const int heads = 2, batch = 2;
  const AttentionParams shape =
      make_contiguous_params(DType::kBFloat16, batch, g.seqlen, g.seqlen, heads, heads,
                             g.head_dim, g.causal, 1.f / std::sqrt(float(g.head_dim)));
  fk::TuneOptions options;
  options.rotate_bytes = size_t{64} << 20;  // a floor: the tuner still rotates over 2x L2
  fk::TuneReport report;
  ASSERT_EQ(fk::tune(shape, nullptr, options, &report), cudaSuccess);

  const std::vector<fk::KernelConfig> all = fk::candidates(DType::kBFloat16, g.head_dim, g.causal);
  ASSERT_EQ(report.timings.size(), all.size());
  ASSERT_GE(report.best, 0);
  ASSERT_LT(report.best, int(report.timings.size()));
  ASSERT_GE(report.default_index, 0);
  EXPECT_EQ(report.timings[report.default_index].config, report.default_config);
  EXPECT_TRUE(report.timings[report.default_index].ok)
      << report.timings[report.default_index].error;
  double fastest_ok = INFINITY;
  int ok_count = 0;
  for (size_t i = 0; i < report.timings.size(); ++i) {
    const fk::CandidateTiming& t = report.timings[i];
    EXPECT_EQ(t.config, all[i]) << "timings must be in candidates() order";
    // Every compiled candidate is correct, so on this grid every one must come back ok.
    EXPECT_TRUE(t.ok) << t.config.name() << ": " << t.error;
    if (!t.ok) continue;
    ++ok_count;
    EXPECT_GT(t.median_ms, 0.0) << t.config.name();
    EXPECT_GT(t.tflops, 0.0) << t.config.name();
    fastest_ok = std::min(fastest_ok, t.median_ms);
  }
  EXPECT_TRUE(report.timings[report.best].ok);
  EXPECT_EQ(report.timings[report.best].median_ms, fastest_ok);
  if (ok_count >= 2) {
    ASSERT_GE(report.runner_up, 0);
    EXPECT_NE(report.runner_up, report.best);
    EXPECT_GE(report.timings[report.runner_up].median_ms, fastest_ok);
  }
  std::printf("%s: best %s %.4f ms (default %s %.4f ms)\n", point_name(g).c_str(),
              report.timings[report.best].config.name().c_str(),
              report.timings[report.best].median_ms, report.default_config.name().c_str(),
              report.timings[report.default_index].median_ms);
  // The winner computes the right function on fresh inputs (odd-sized too: the tuner only saw
  // one shape), against the fp64 reference.
  expect_correct(shape, report.timings[report.best].config, point_name(g));
  AttentionParams odd = make_contiguous_params(DType::kBFloat16, 1, 97, g.seqlen / 4 + 3, 3, 3,
                                               g.head_dim, g.causal,
                                               1.f / std::sqrt(float(g.head_dim)));
  expect_correct(odd, report.timings[report.best].config, point_name(g) + "_odd");
}

INSTANTIATE_TEST_SUITE_P(Small, TunerGrid,
                         ::testing::Values(GridPoint{64, false, 256}, GridPoint{64, true, 256},
                                           GridPoint{64, false, 1024}, GridPoint{64, true, 1024},
                                           GridPoint{128, false, 256}, GridPoint{128, true, 256},
                                           GridPoint{128, false, 1024},
                                           GridPoint{128, true, 1024}),
                         [](const ::testing::TestParamInfo<GridPoint>& param_info) {
                           return point_name(param_info.param);
                         });

TEST(Tuner, UnsupportedProblemIsInvalidValue) {
  SKIP_WITHOUT_GPU();
  fk::TuneOptions options;
  fk::TuneReport report;
  // head_dim 48 has no kernel in any build.
  AttentionParams p = make_contiguous_params(DType::kBFloat16, 1, 128, 128, 2, 2, 48, false, 0.1f);
  EXPECT_EQ(fk::tune(p, nullptr, options, &report), cudaErrorInvalidValue);
  EXPECT_EQ(report.best, -1);
  // fp32 is CPU-only.
  p = make_contiguous_params(DType::kFloat32, 1, 128, 128, 2, 2, 64, false, 0.1f);
  EXPECT_EQ(fk::tune(p, nullptr, options, &report), cudaErrorInvalidValue);
  // GQA ratio that does not divide.
  p = make_contiguous_params(DType::kBFloat16, 1, 128, 128, 3, 2, 64, false, 0.1f);
  EXPECT_EQ(fk::tune(p, nullptr, options, &report), cudaErrorInvalidValue);
  // Nothing to time.
  p = make_contiguous_params(DType::kBFloat16, 0, 128, 128, 2, 2, 64, false, 0.1f);
  EXPECT_EQ(fk::tune(p, nullptr, options, &report), cudaErrorInvalidValue);
  // Fewer than 20 repetitions: no honest median.
  p = make_contiguous_params(DType::kBFloat16, 1, 128, 128, 2, 2, 64, false, 0.1f);
  options.repetitions = 5;
  EXPECT_EQ(fk::tune(p, nullptr, options, &report), cudaErrorInvalidValue);
  EXPECT_EQ(fk::tune(p, nullptr, fk::TuneOptions{}, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(Tuner, LeaksNoDeviceMemory) {
  SKIP_WITHOUT_GPU();
  const int head_dim = compiled(DType::kBFloat16, 128) ? 128 : 64;
  const AttentionParams p = make_contiguous_params(DType::kBFloat16, 2, 1024, 1024, 4, 2,
                                                   head_dim, true, 0.1f);
  fk::TuneOptions options;
  fk::TuneReport report;
  // The first call loads the kernels' modules (lazy loading allocates device memory once).
  ASSERT_EQ(fk::tune(p, nullptr, options, &report), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t before = free_device_memory();
  for (int i = 0; i < 3; ++i) ASSERT_EQ(fk::tune(p, nullptr, options, &report), cudaSuccess);
  // Error paths after allocation-free validation must not leak either.
  AttentionParams bad = p;
  bad.head_dim = 48;
  EXPECT_EQ(fk::tune(bad, nullptr, options, &report), cudaErrorInvalidValue);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(free_device_memory(), before);
}

TEST(Tuner, TooLargeProblemIsMemoryAllocationAndLeaksNothing) {
  SKIP_WITHOUT_GPU();
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  // Q alone larger than the whole device.
  const int64_t rows = int64_t(total / (2 * 2 * 64 * 64)) + 1;  // batch * seqlen rows of 64 heads
  const int seqlen = 1 << 20;
  const int batch = int(std::min<int64_t>(65535, (rows + seqlen - 1) / seqlen));
  const AttentionParams p =
      make_contiguous_params(DType::kBFloat16, batch, seqlen, 16, 64, 64, 64, false, 0.1f);
  fk::TuneReport report;
  const size_t before = free_device_memory();
  EXPECT_EQ(fk::tune(p, nullptr, fk::TuneOptions{}, &report), cudaErrorMemoryAllocation);
  EXPECT_EQ(report.best, -1);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(free_device_memory(), before);
}

}  // namespace
}  // namespace flashserve::kernels
