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
#include "gpu_test_util.h"
#include "flashserve/kernels/float_convert.h"
#include "flashserve/kernels/reference_attention.h"
#include "flashserve/kernels/tuner.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;

using testing_util::compiled;
using testing_util::gpu_available;


struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

double rel_l2(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double max_abs(const std::vector<double>& x, const std::vector<double>& ref) {
  double m = 0;
  for (size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - ref[i]));
  return m;
}

// Runs cfg on fresh random inputs and checks it against the fp64 reference.
void expect_correct(const AttentionParams& shape, const fk::KernelConfig& cfg, uint64_t seed) {
  SCOPED_TRACE("config " + cfg.name());
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t q_elems = size_t(shape.batch) * shape.seqlen_q * shape.heads_q * shape.head_dim;
  const size_t kv_elems = size_t(shape.batch) * shape.seqlen_k * shape.heads_kv * shape.head_dim;
  auto random_tensor = [&](size_t n) {
    std::vector<uint16_t> t(n);
    for (auto& x : t) x = float_to_bf16(normal(rng));
    return t;
  };
  const std::vector<uint16_t> q = random_tensor(q_elems), k = random_tensor(kv_elems),
                              v = random_tensor(kv_elems);
  AttentionParams p = shape;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  std::vector<double> ref_out, ref_lse, emu_out, emu_lse;
  reference::attention_fp64(p, &ref_out, &ref_lse);
  reference::EmulationOptions emulation;  // how cfg rounds P (cuda_attention_test.cc)
  emulation.block_n = cfg.block_n;
  emulation.backwards = true;
  emulation.rescale_threshold_log2 = cfg.rescale_threshold_log2();
  reference::attention_emulated(p, emulation, &emu_out, &emu_lse);

  DeviceBuffer dq(q_elems * 2), dk(kv_elems * 2), dv(kv_elems * 2), dout(q_elems * 2);
  ASSERT_EQ(cudaMemcpy(dq.ptr, q.data(), q_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.ptr, k.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.ptr, v.data(), kv_elems * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemset(dout.ptr, 0xFF, q_elems * 2), cudaSuccess);  // NaN poison
  p.q = dq.ptr;
  p.k = dk.ptr;
  p.v = dv.ptr;
  p.o = dout.ptr;
  p.lse = nullptr;
  ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(q_elems);
  ASSERT_EQ(cudaMemcpy(out.data(), dout.ptr, q_elems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<double> out_d(q_elems);
  for (size_t i = 0; i < q_elems; ++i) {
    out_d[i] = bf16_to_float(out[i]);
    ASSERT_TRUE(std::isfinite(out_d[i])) << "element " << i << " is NaN/Inf (or unwritten)";
  }
  EXPECT_LE(max_abs(out_d, ref_out), 2 * max_abs(emu_out, ref_out) + 1e-6);
  EXPECT_LE(rel_l2(out_d, ref_out), 2 * rel_l2(emu_out, ref_out) + 1e-6);
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
  std::random_device rd;
  expect_correct(shape, report.timings[report.best].config, (uint64_t(rd()) << 32) ^ rd());
  AttentionParams odd = make_contiguous_params(DType::kBFloat16, 1, 97, g.seqlen / 4 + 3, 3, 3,
                                               g.head_dim, g.causal,
                                               1.f / std::sqrt(float(g.head_dim)));
  expect_correct(odd, report.timings[report.best].config, (uint64_t(rd()) << 32) ^ rd());
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
