// The shared checks of gpu_test_support.h fail where they should, on host data alone (no GPU):
// the emulation's own output stands in for a kernel's, then is broken on purpose (3x its error,
// one unwritten element, wrong LSE rows). The kernel tests rely on these failing.
#include "gpu_test_support.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace flashserve::kernels {
namespace {

namespace tu = testing_util;

// Causal with seqlen_q > seqlen_k: the first rows see no key (LSE -inf, O 0).
struct Problem {
  AttentionParams p;
  tu::HostQkv qkv;
};

Problem causal_problem(DType dtype) {
  Problem pr;
  pr.p = make_contiguous_params(dtype, 2, 53, 37, 4, 2, 32, true, 1.f / std::sqrt(32.f));
  std::mt19937_64 rng(tu::case_seed("causal_problem"));
  pr.qkv = tu::random_qkv(&pr.p, 1.f, rng);
  return pr;
}

// The emulation's output and LSE, as a kernel that rounds like it would return them.
void emulated_result(const AttentionParams& p, std::vector<double>* out, std::vector<float>* lse) {
  std::vector<double> lse_d;
  reference::attention_emulated(p, reference::EmulationOptions{}, out, &lse_d);
  lse->assign(lse_d.begin(), lse_d.end());
}

TEST(GpuTestSupport, OutputChecksFailOnBrokenResults) {
  const Problem pr = causal_problem(DType::kBFloat16);
  tu::Fp64Reference ref(pr.p);
  const tu::EmulatedError& emu = ref.emulated(reference::EmulationOptions{});
  std::vector<double> out;
  std::vector<float> lse;
  emulated_result(pr.p, &out, &lse);
  ASSERT_GT(emu.out.max_abs, 0.0) << "bf16 rounding must show";
  EXPECT_TRUE(tu::all_finite(out));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(out, ref.out()), emu.out));
  // The emulation's error scaled by `factor`: within tolerance up to 2x, out of it past 2x.
  auto scaled_error = [&](double factor) {
    std::vector<double> x(out.size());
    for (size_t i = 0; i < out.size(); ++i) x[i] = ref.out()[i] + factor * (out[i] - ref.out()[i]);
    return tu::error_vs(x, ref.out());
  };
  EXPECT_TRUE(tu::within_twice_emulated(scaled_error(1.9), emu.out));
  EXPECT_FALSE(tu::within_twice_emulated(scaled_error(2.1), emu.out));
  // Each bound on its own: max abs, relative L2.
  const tu::ErrorStats e = emu.out;
  EXPECT_FALSE(tu::within_twice_emulated({2.1 * e.max_abs, e.rel_l2}, e));
  EXPECT_FALSE(tu::within_twice_emulated({e.max_abs, 2.1 * e.rel_l2}, e));
  // One element left as the poison (never written).
  std::vector<double> unwritten = out;
  unwritten[out.size() / 2] = tu::to_double(DType::kBFloat16, uint16_t{0xFFFF});
  EXPECT_FALSE(tu::all_finite(unwritten));
  EXPECT_FALSE(tu::within_twice_emulated(tu::error_vs(unwritten, ref.out()), emu.out));
}

TEST(GpuTestSupport, LseChecksFailOnWrongRows) {
  const Problem pr = causal_problem(DType::kFloat16);
  tu::Fp64Reference ref(pr.p);
  const double emu_lse = ref.emulated(reference::EmulationOptions{}).lse;
  std::vector<double> out;
  std::vector<float> lse;
  emulated_result(pr.p, &out, &lse);
  ASSERT_TRUE(std::isinf(ref.lse()[0])) << "row 0 sees no key in this problem";
  ASSERT_TRUE(std::isfinite(ref.lse().back()));
  EXPECT_TRUE(tu::lse_matches(lse, ref.lse(), emu_lse));
  std::vector<float> bad = lse;
  bad[0] = 0.f;  // a row that sees no key must be -inf
  EXPECT_FALSE(tu::lse_matches(bad, ref.lse(), emu_lse));
  bad = lse;
  bad.back() = std::numeric_limits<float>::quiet_NaN();  // poison left in place
  EXPECT_FALSE(tu::lse_matches(bad, ref.lse(), emu_lse));
  bad = lse;
  bad.back() += 0.01f;  // far past 2x the emulation's error + 1e-4
  EXPECT_FALSE(tu::lse_matches(bad, ref.lse(), emu_lse));
}

// The poison memset byte is NaN in every element type the kernels write.
TEST(GpuTestSupport, PoisonIsNanInEveryDtype) {
  const uint16_t half_bits = uint16_t(tu::kPoisonByte * 0x0101);
  EXPECT_TRUE(std::isnan(tu::to_double(DType::kFloat16, half_bits)));
  EXPECT_TRUE(std::isnan(tu::to_double(DType::kBFloat16, half_bits)));
  uint32_t float_bits = 0;
  std::memset(&float_bits, tu::kPoisonByte, sizeof(float_bits));
  float f = 0;
  std::memcpy(&f, &float_bits, sizeof(f));
  EXPECT_TRUE(std::isnan(f));
}

// Padded strides: the fp64 reference reads the padded layout, so it must agree with the same
// values in a contiguous layout (gather_output does the copy).
TEST(GpuTestSupport, PaddedLayoutGathersToContiguous) {
  AttentionParams padded =
      make_contiguous_params(DType::kBFloat16, 2, 19, 23, 4, 2, 32, false, 0.2f);
  tu::pad_strides(&padded, 3, 5);
  std::mt19937_64 rng(tu::case_seed("padded"));
  const tu::HostQkv qkv = tu::random_qkv(&padded, 1.f, rng);
  ASSERT_EQ(qkv.q.size(), tu::q_elements(padded));
  ASSERT_EQ(qkv.q.size(), size_t(2) * (19 + 5) * (4 + 3) * 32);
  AttentionParams contiguous = padded;  // q only: k and v keep their padded layout
  const AttentionParams dense =
      make_contiguous_params(DType::kBFloat16, 2, 19, 23, 4, 2, 32, false, 0.2f);
  contiguous.q_row_stride = dense.q_row_stride;
  contiguous.q_batch_stride = dense.q_batch_stride;
  const std::vector<double> q_gathered = tu::gather_output(padded, qkv.q);  // Q has O's layout
  std::vector<uint16_t> q_dense(q_gathered.size());
  for (size_t i = 0; i < q_dense.size(); ++i)
    q_dense[i] = tu::to_bits(DType::kBFloat16, float(q_gathered[i]));
  contiguous.q = q_dense.data();
  tu::Fp64Reference a(padded), b(contiguous);
  EXPECT_EQ(a.out(), b.out());
  EXPECT_EQ(a.lse(), b.lse());
}

TEST(GpuTestSupport, CaseSeedsDifferByNameAndRepeat) {
  EXPECT_NE(tu::case_seed("a"), tu::case_seed("b"));
  EXPECT_EQ(tu::case_seed("a"), tu::case_seed("a"));
  std::mt19937_64 r1(tu::case_seed("x")), r2(tu::case_seed("x"));
  EXPECT_EQ(tu::random_tensor(DType::kFloat16, 64, 1.f, r1),
            tu::random_tensor(DType::kFloat16, 64, 1.f, r2));
}

}  // namespace
}  // namespace flashserve::kernels
