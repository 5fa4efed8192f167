// CPU attention backend vs the fp64 reference on fresh random inputs (seed printed on failure),
// plus the thread pool, supported(), NaN propagation and the references themselves.
#include "flashserve/kernels/cpu_attention.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../../kernels/cpu/tile_kernel.h"  // Isa, attention_forward_isa (internal)
#include "flashserve/kernels/float_convert.h"
#include "flashserve/kernels/reference_attention.h"

namespace flashserve::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr DType kAllDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// fp32 arithmetic error allowed on top of the output rounding, relative to max|O|: the backend
// accumulates in fp32 with a ~2e-7 exp2, measured at ~1e-6; 1e-5 is the bound.
constexpr double kFp32Slack = 1e-5;

// Unit roundoff (half an ulp, relative) of storing a value in dtype, round to nearest even.
double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
    case DType::kFloat32:
      break;
  }
  return std::ldexp(1.0, -24);
}

// Smallest absolute rounding step near zero: fp16's subnormal half-ulp; others are negligible.
double absolute_roundoff(DType dtype) {
  return dtype == DType::kFloat16 ? std::ldexp(1.0, -25) : 0.0;
}

std::vector<cpu::Isa> available_isas() {
  std::vector<cpu::Isa> isas;
  for (cpu::Isa isa : {cpu::Isa::kScalar, cpu::Isa::kAvx2, cpu::Isa::kAvx512}) {
    if (cpu::isa_available(isa)) isas.push_back(isa);
  }
  return isas;
}

uint32_t fresh_seed() { return std::random_device{}(); }

struct Shape {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim;
  bool causal;
  bool strided = false;  // padded q/o rows and heads, k and v interleaved in one buffer
  float scale = 0.f;     // 0: 1/sqrt(head_dim)
  float input_std = 1.f;
};

std::string describe(const Shape& s, DType dtype) {
  return std::string(dtype_name(dtype)) + " b" + std::to_string(s.batch) + " sq" +
         std::to_string(s.seqlen_q) + " sk" + std::to_string(s.seqlen_k) + " h" +
         std::to_string(s.heads_q) + ":" + std::to_string(s.heads_kv) + " d" +
         std::to_string(s.head_dim) + (s.causal ? " causal" : "") + (s.strided ? " strided" : "");
}

// Inputs and outputs of one problem. Buffer elements outside the q/k/v views are NaN, so a
// kernel that reads outside its view produces NaN; o and lse start as NaN (poison), and o's
// elements outside its view must still hold the poison afterwards.
struct Problem {
  AttentionParams p;
  std::vector<uint16_t> q, kv, o;  // raw storage in units of 2 bytes (fp32 uses 2 units)
  std::vector<float> lse;
  std::vector<char> o_in_view;

  Problem(const Problem&) = delete;  // p points into this object's own buffers
  Problem(Problem&&) = default;
  Problem(const Shape& s, DType dtype, std::mt19937& rng) {
    const float scale = s.scale > 0 ? s.scale : 1.f / std::sqrt(float(s.head_dim));
    p = make_contiguous_params(dtype, s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv,
                               s.head_dim, s.causal, scale);
    const int64_t d = s.head_dim;
    int64_t kv_elements = 2 * p.k_batch_stride * s.batch;
    int64_t v_offset = p.k_batch_stride * s.batch;
    if (s.strided) {
      p.q_head_stride = d + 3;
      p.q_row_stride = s.heads_q * (d + 3) + 5;
      p.q_batch_stride = p.q_row_stride * s.seqlen_q + 7;
      p.o_head_stride = d + 1;
      p.o_row_stride = s.heads_q * (d + 1) + 2;
      p.o_batch_stride = p.o_row_stride * s.seqlen_q + 3;
      // [batch, seqlen_k, 2, heads_kv, head_dim]: k and v views into one packed buffer.
      p.k_head_stride = p.v_head_stride = d;
      p.k_row_stride = p.v_row_stride = 2 * s.heads_kv * d;
      p.k_batch_stride = p.v_batch_stride = p.k_row_stride * s.seqlen_k;
      kv_elements = p.k_batch_stride * s.batch;
      v_offset = s.heads_kv * d;
    }
    const size_t units = dtype_size(dtype) / 2;
    q.assign(p.q_batch_stride * s.batch * units, 0);
    kv.assign(kv_elements * units, 0);
    o.assign(p.o_batch_stride * s.batch * units, 0);
    o_in_view.assign(p.o_batch_stride * s.batch, 0);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int64_t i = 0; i < p.q_batch_stride * s.batch; ++i) store_element(q.data(), i, dtype, nan);
    for (int64_t i = 0; i < kv_elements; ++i) store_element(kv.data(), i, dtype, nan);
    for (int64_t i = 0; i < p.o_batch_stride * s.batch; ++i) store_element(o.data(), i, dtype, nan);
    lse.assign(size_t(s.batch) * s.heads_q * s.seqlen_q, nan);

    std::normal_distribution<float> normal(0.f, s.input_std);
    const auto fill = [&](void* base, int64_t offset, int64_t bs, int64_t rs, int64_t hs, int rows,
                          int heads) {
      for (int b = 0; b < s.batch; ++b)
        for (int r = 0; r < rows; ++r)
          for (int h = 0; h < heads; ++h)
            for (int c = 0; c < d; ++c)
              store_element(base, offset + b * bs + r * rs + h * hs + c, dtype, normal(rng));
    };
    fill(q.data(), 0, p.q_batch_stride, p.q_row_stride, p.q_head_stride, s.seqlen_q, s.heads_q);
    fill(kv.data(), 0, p.k_batch_stride, p.k_row_stride, p.k_head_stride, s.seqlen_k, s.heads_kv);
    fill(kv.data(), v_offset, p.v_batch_stride, p.v_row_stride, p.v_head_stride, s.seqlen_k,
         s.heads_kv);
    for (int b = 0; b < s.batch; ++b)
      for (int r = 0; r < s.seqlen_q; ++r)
        for (int h = 0; h < s.heads_q; ++h)
          for (int c = 0; c < d; ++c)
            o_in_view[b * p.o_batch_stride + r * p.o_row_stride + h * p.o_head_stride + c] = 1;

    p.q = q.data();
    p.k = kv.data();
    p.v = kv.data() + v_offset * units;
    p.o = o.data();
    p.lse = lse.data();
  }

  void poison_outputs() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i < o_in_view.size(); ++i) store_element(o.data(), int64_t(i), p.dtype, nan);
    std::fill(lse.begin(), lse.end(), nan);
  }

  // Output element (b, i, h, c) as float.
  float out(int b, int i, int h, int c) const {
    return load_element(
        o.data(), b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + c, p.dtype);
  }
  float lse_at(int b, int h, int i) const {
    return lse[(size_t(b) * p.heads_q + h) * p.seqlen_q + i];
  }
};

size_t ref_index(const AttentionParams& p, int b, int i, int h, int c) {
  return ((size_t(b) * p.seqlen_q + i) * p.heads_q + h) * p.head_dim + c;
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

// Checks the backend's O and LSE against reference values:
//   |O - O_ref| <= u * |O_ref| + out_slack          (u: the output dtype's unit roundoff)
//   |LSE - LSE_ref| <= lse_slack * (1 + |LSE_ref|)
// Rows that see no key must be exactly O = 0, LSE = -inf; o outside its view must be untouched.
void expect_matches(const Problem& t, const std::vector<double>& ref_o,
                    const std::vector<double>& ref_lse, double out_slack, double lse_slack) {
  const AttentionParams& p = t.p;
  const double u = unit_roundoff(p.dtype);
  int failures = 0;
  double worst = 0;
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      for (int i = 0; i < p.seqlen_q; ++i) {
        const double r_lse = ref_lse[(size_t(b) * p.heads_q + h) * p.seqlen_q + i];
        const double lse = t.lse_at(b, h, i);
        if (r_lse == -kInf) {
          EXPECT_EQ(lse, -kInf) << "b" << b << " h" << h << " row " << i;
        } else if (!(std::abs(lse - r_lse) <= lse_slack * (1 + std::abs(r_lse))) &&
                   ++failures <= 5) {
          ADD_FAILURE() << "lse b" << b << " h" << h << " row " << i << ": " << lse << " vs "
                        << r_lse;
        }
        for (int c = 0; c < p.head_dim; ++c) {
          const double r = ref_o[ref_index(p, b, i, h, c)];
          const double o = t.out(b, i, h, c);
          const double err = std::abs(o - r);
          if (r_lse == -kInf) {
            if (o != 0.0 && ++failures <= 5)
              ADD_FAILURE() << "row with no key: O[" << c << "] = " << o;
            continue;
          }
          worst = std::max(worst, std::isnan(err) ? kInf : err);
          if (!(err <= u * std::abs(r) + out_slack) && ++failures <= 5) {
            ADD_FAILURE() << "O b" << b << " row " << i << " h" << h << " c" << c << ": " << o
                          << " vs " << r << " (tolerance " << u * std::abs(r) + out_slack << ")";
          }
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << "max |O - O_ref| = " << worst;
  // The poison outside o's view (strided layouts) is still there.
  std::vector<uint16_t> poison(t.o.size());
  for (size_t i = 0; i < t.o_in_view.size(); ++i)
    store_element(poison.data(), int64_t(i), p.dtype, std::numeric_limits<float>::quiet_NaN());
  for (size_t i = 0; i < t.o_in_view.size(); ++i) {
    if (t.o_in_view[i]) continue;
    const size_t bytes = dtype_size(p.dtype);
    ASSERT_EQ(std::memcmp(reinterpret_cast<const char*>(t.o.data()) + i * bytes,
                          reinterpret_cast<const char*>(poison.data()) + i * bytes, bytes),
              0)
        << "wrote outside o's view at element " << i;
  }
}

// Runs every available ISA (and the public entry point) on one problem against fp64.
void check_against_fp64(const Shape& shape, DType dtype, cpu::ThreadPool* pool) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(describe(shape, dtype) + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Problem t(shape, dtype, rng);
  std::vector<double> ref_o, ref_lse;
  reference::attention_fp64(t.p, &ref_o, &ref_lse);
  const double out_slack = kFp32Slack * max_abs(ref_o) + absolute_roundoff(dtype);
  for (cpu::Isa isa : available_isas()) {
    SCOPED_TRACE(cpu::isa_name(isa));
    t.poison_outputs();
    cpu::attention_forward_isa(t.p, pool, isa);
    expect_matches(t, ref_o, ref_lse, out_slack, kFp32Slack);
  }
  t.poison_outputs();
  cpu::attention_forward(t.p, pool);
  expect_matches(t, ref_o, ref_lse, out_slack, kFp32Slack);
}

class CpuAttention : public ::testing::Test {
 protected:
  cpu::ThreadPool pool_{2};
};

TEST_F(CpuAttention, TinyAndOddSizes) {
  const Shape shapes[] = {
      {1, 1, 1, 1, 1, 64, false},  {1, 1, 1, 1, 1, 1, true},      {2, 17, 17, 3, 3, 64, false},
      {2, 17, 97, 3, 3, 1, false}, {1, 97, 97, 3, 3, 128, true},  {1, 33, 65, 3, 3, 40, false},
      {1, 20, 70, 2, 2, 17, true}, {1, 64, 64, 2, 2, 256, false}, {1, 65, 129, 1, 1, 256, true},
  };
  for (const Shape& s : shapes)
    for (DType dtype : kAllDtypes) check_against_fp64(s, dtype, &pool_);
}

TEST_F(CpuAttention, GroupedQueryAndMultiQuery) {
  const Shape shapes[] = {
      {1, 1, 1025, 8, 2, 128, false},  // decode against a long cache
      {2, 65, 97, 8, 2, 64, true},
      {1, 97, 200, 6, 1, 80, false},
      {1, 40, 40, 6, 1, 96, true},
  };
  for (const Shape& s : shapes)
    for (DType dtype : kAllDtypes) check_against_fp64(s, dtype, &pool_);
}

TEST_F(CpuAttention, CausalWithUnequalSeqlens) {
  const Shape shapes[] = {
      {1, 97, 1025, 8, 2, 80, true},  // Sq < Sk: every row sees a prefix of the cache
      {1, 1025, 97, 6, 1, 64, true},  // Sq > Sk: the first 928 rows see no key (O = 0, LSE = -inf)
      {2, 130, 60, 3, 3, 128, true},  // Sq > Sk within one tile
      {1, 300, 200, 4, 4, 96, false},
  };
  for (const Shape& s : shapes)
    for (DType dtype : kAllDtypes) check_against_fp64(s, dtype, &pool_);
}

TEST_F(CpuAttention, LongCausalSelfAttention) {
  for (DType dtype : kAllDtypes) check_against_fp64({1, 1025, 1025, 3, 3, 64, true}, dtype, &pool_);
}

TEST_F(CpuAttention, NonContiguousStrides) {
  const Shape shapes[] = {
      {2, 33, 65, 3, 3, 40, false, true},
      {1, 65, 130, 4, 2, 128, true, true},
      {2, 17, 17, 6, 1, 256, true, true},
  };
  for (const Shape& s : shapes)
    for (DType dtype : kAllDtypes) check_against_fp64(s, dtype, &pool_);
}

TEST_F(CpuAttention, SoftmaxScale) {
  Shape s{1, 70, 90, 2, 2, 64, true};
  s.scale = 0.37f;
  for (DType dtype : kAllDtypes) check_against_fp64(s, dtype, &pool_);
}

TEST_F(CpuAttention, ResultIndependentOfThreading) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Problem t({2, 200, 300, 4, 2, 64, true}, DType::kBFloat16, rng);
  cpu::attention_forward(t.p, nullptr);
  const std::vector<uint16_t> serial_o = t.o;
  const std::vector<float> serial_lse = t.lse;
  for (int threads : {1, 2, 5}) {
    cpu::ThreadPool pool(threads);
    t.poison_outputs();
    cpu::attention_forward(t.p, &pool);
    EXPECT_EQ(t.o, serial_o) << threads << " threads";
    EXPECT_EQ(std::memcmp(t.lse.data(), serial_lse.data(), sizeof(float) * t.lse.size()), 0);
  }
}

// Several threads run attention on one shared pool at once (the server's CPU backend does).
TEST_F(CpuAttention, ConcurrentCallersOnOnePool) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::vector<Problem> problems;
  for (int c = 0; c < 3; ++c)
    problems.emplace_back(Shape{1, 90, 130, 4, 2, 64, c == 1}, DType::kFloat16, rng);
  std::vector<std::vector<uint16_t>> expected;
  for (Problem& t : problems) {
    cpu::attention_forward(t.p, nullptr);
    expected.push_back(t.o);
    t.poison_outputs();
  }
  std::vector<std::thread> callers;
  for (Problem& t : problems) {
    callers.emplace_back([&t, this] {
      for (int round = 0; round < 5; ++round) cpu::attention_forward(t.p, &pool_);
    });
  }
  for (std::thread& c : callers) c.join();
  for (size_t c = 0; c < problems.size(); ++c)
    EXPECT_EQ(problems[c].o, expected[c]) << "caller " << c;
}

// scale 10 with N(0, 3) inputs: logits in the thousands, softmax near one-hot. Nothing may
// overflow, and the error must stay within what fp32 scores allow. Softmax conditioning: score
// errors delta_j move O_c by at most max|delta| * sum_j P_j |V_jc - O_c|, and an fp32 d-term dot
// product errs by about sqrt(d) * u32 * sum_x |q_x k_x| (probabilistic rounding bound, Higham &
// Mary 2019); the exp2 polynomial adds 2e-7 per probability. The tolerance is twice that, per
// element, plus the output rounding and fp32 underflow; LSE moves by at most max|delta|.
TEST_F(CpuAttention, LargeLogitsDoNotOverflow) {
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (bool causal : {false, true}) {
      Shape s{1, 150, 150, 2, 2, 64, causal};
      s.scale = 10.f;
      s.input_std = 3.f;
      const uint32_t seed = fresh_seed();
      SCOPED_TRACE(describe(s, dtype) + " seed " + std::to_string(seed));
      std::mt19937 rng(seed);
      Problem t(s, dtype, rng);
      const AttentionParams& p = t.p;
      std::vector<double> ref_o, ref_lse;
      reference::attention_fp64(p, &ref_o, &ref_lse);
      const double u32 = std::ldexp(1.0, -24), u = unit_roundoff(dtype);
      const auto element = [&](const void* base, int64_t row_stride, int row, int h, int c) {
        return double(load_element(base, row * row_stride + h * int64_t{s.head_dim} + c, dtype));
      };
      // Tolerances from the fp64 probabilities P_j = exp(s_j - LSE).
      std::vector<double> tol_o(ref_o.size()), tol_lse(ref_lse.size());
      std::vector<double> prob(s.seqlen_k);
      for (int h = 0; h < s.heads_q; ++h) {
        for (int i = 0; i < s.seqlen_q; ++i) {
          const int visible =
              causal ? std::min(s.seqlen_k, i + s.seqlen_k - s.seqlen_q + 1) : s.seqlen_k;
          const double lse = ref_lse[size_t(h) * s.seqlen_q + i];
          double score_magnitude = 0;
          for (int j = 0; j < visible; ++j) {
            double dot = 0, abs_dot = 0;
            for (int c = 0; c < s.head_dim; ++c) {
              const double qk =
                  element(p.q, p.q_row_stride, i, h, c) * element(p.k, p.k_row_stride, j, h, c);
              dot += qk;
              abs_dot += std::abs(qk);
            }
            prob[j] = std::exp(double(p.softmax_scale) * dot - lse);
            score_magnitude = std::max(score_magnitude, double(p.softmax_scale) * abs_dot);
          }
          const double delta = std::sqrt(double(s.head_dim)) * u32 * score_magnitude + 2e-7;
          tol_lse[size_t(h) * s.seqlen_q + i] = 2 * delta + 1e-6 * (1 + std::abs(lse));
          for (int c = 0; c < s.head_dim; ++c) {
            const size_t at = ref_index(p, 0, i, h, c);
            double spread = 0, v_sum = 0;
            for (int j = 0; j < visible; ++j) {
              const double v = element(p.v, p.v_row_stride, j, h, c);
              spread += prob[j] * std::abs(v - ref_o[at]);
              v_sum += std::abs(v);
            }
            // Probabilities below fp32's smallest normal (2^-126) may flush to zero.
            tol_o[at] = 2 * delta * spread + u * std::abs(ref_o[at]) + 1e-6 * std::abs(ref_o[at]) +
                        std::ldexp(v_sum, -126);
          }
        }
      }
      for (cpu::Isa isa : available_isas()) {
        SCOPED_TRACE(cpu::isa_name(isa));
        t.poison_outputs();
        cpu::attention_forward_isa(p, &pool_, isa);
        int failures = 0;
        for (int h = 0; h < s.heads_q; ++h) {
          for (int i = 0; i < s.seqlen_q; ++i) {
            const size_t row = size_t(h) * s.seqlen_q + i;
            ASSERT_TRUE(std::isfinite(t.lse_at(0, h, i)));
            if (!(std::abs(t.lse_at(0, h, i) - ref_lse[row]) <= tol_lse[row]) && ++failures <= 5) {
              ADD_FAILURE() << "lse h" << h << " row " << i << ": " << t.lse_at(0, h, i) << " vs "
                            << ref_lse[row];
            }
            for (int c = 0; c < s.head_dim; ++c) {
              const size_t at = ref_index(p, 0, i, h, c);
              const double o = t.out(0, i, h, c);
              ASSERT_TRUE(std::isfinite(o));
              if (!(std::abs(o - ref_o[at]) <= tol_o[at]) && ++failures <= 5) {
                ADD_FAILURE() << "O h" << h << " row " << i << " c" << c << ": " << o << " vs "
                              << ref_o[at] << " (tolerance " << tol_o[at] << ")";
              }
            }
          }
        }
        EXPECT_EQ(failures, 0);
      }
    }
  }
}

// NaN in an input reaches exactly the outputs that depend on it (rows that see the key), and no
// other: a causal row that cannot see a NaN key stays finite.
TEST_F(CpuAttention, NanPropagatesOnlyToDependentRows) {
  const int kNanRow = 41, kNanCol = 7;  // 41: inside a row group, so neighbours differ
  for (DType dtype : kAllDtypes) {
    for (cpu::Isa isa : available_isas()) {
      for (int which = 0; which < 3; ++which) {  // 0: q, 1: k, 2: v
        const uint32_t seed = fresh_seed();
        const Shape s{1, 70, 70, 2, 2, 64, true};
        SCOPED_TRACE(describe(s, dtype) + " " + cpu::isa_name(isa) + " NaN in " + "qkv"[which] +
                     " seed " + std::to_string(seed));
        std::mt19937 rng(seed);
        Problem t(s, dtype, rng);
        const AttentionParams& p = t.p;
        const float nan = std::numeric_limits<float>::quiet_NaN();
        void* base = which == 0   ? const_cast<void*>(p.q)
                     : which == 1 ? const_cast<void*>(p.k)
                                  : const_cast<void*>(p.v);
        const int64_t row_stride = which == 0   ? p.q_row_stride
                                   : which == 1 ? p.k_row_stride
                                                : p.v_row_stride;
        store_element(base, kNanRow * row_stride + kNanCol, dtype, nan);  // head 0
        cpu::attention_forward_isa(p, &pool_, isa);
        for (int h = 0; h < 2; ++h) {
          for (int i = 0; i < s.seqlen_q; ++i) {
            const bool row_hit = h == 0 && (which == 0 ? i == kNanRow : i >= kNanRow);
            EXPECT_EQ(std::isnan(t.lse_at(0, h, i)), row_hit && which != 2)
                << "lse h" << h << " row " << i;
            for (int c = 0; c < s.head_dim; ++c) {
              const bool hit = row_hit && (which != 2 || c == kNanCol);
              const float o = t.out(0, i, h, c);
              if (hit) {
                ASSERT_TRUE(std::isnan(o)) << "h" << h << " row " << i << " c" << c;
              } else {
                ASSERT_TRUE(std::isfinite(o)) << "h" << h << " row " << i << " c" << c << ": " << o;
              }
            }
          }
        }
      }
    }
  }
}

TEST(CpuAttentionSupported, AcceptsValidProblems) {
  float buffer[8] = {};
  AttentionParams p = make_contiguous_params(DType::kBFloat16, 1, 1, 1, 8, 2, 256, true, 0.1f);
  p.q = p.k = p.v = p.o = buffer;
  EXPECT_EQ(cpu::supported(p), "");
  p.head_dim = 1;
  EXPECT_EQ(cpu::supported(p), "");
}

TEST(CpuAttentionSupported, RejectsEachBadFieldByName) {
  float buffer[8] = {};
  const AttentionParams good = [&] {
    AttentionParams p = make_contiguous_params(DType::kFloat16, 2, 3, 4, 6, 3, 64, false, 0.125f);
    p.q = p.k = p.v = p.o = buffer;
    return p;
  }();
  struct Case {
    void (*mutate)(AttentionParams&);
    const char* expected;
  };
  const Case cases[] = {
      {[](AttentionParams& p) { p.dtype = static_cast<DType>(7); }, "dtype"},
      {[](AttentionParams& p) { p.dtype = static_cast<DType>(0); }, "dtype"},
      {[](AttentionParams& p) { p.batch = 0; }, "batch"},
      {[](AttentionParams& p) { p.seqlen_q = -1; }, "seqlen_q"},
      {[](AttentionParams& p) { p.seqlen_k = 0; }, "seqlen_k"},
      {[](AttentionParams& p) { p.heads_q = 0; }, "heads_q"},
      {[](AttentionParams& p) { p.heads_kv = 0; }, "heads_kv"},
      {[](AttentionParams& p) { p.heads_kv = 4; }, "heads_q 6 is not a multiple of heads_kv 4"},
      {[](AttentionParams& p) { p.head_dim = 0; }, "head_dim"},
      {[](AttentionParams& p) { p.head_dim = 300; },
       "head_dim 300 exceeds the CPU backend maximum 256"},
      {[](AttentionParams& p) { p.q = nullptr; }, "q is null"},
      {[](AttentionParams& p) { p.k = nullptr; }, "k is null"},
      {[](AttentionParams& p) { p.v = nullptr; }, "v is null"},
      {[](AttentionParams& p) { p.o = nullptr; }, "o is null"},
      {[](AttentionParams& p) { p.softmax_scale = 0.f; }, "softmax_scale"},
      {[](AttentionParams& p) { p.softmax_scale = -1.f; }, "softmax_scale"},
      {[](AttentionParams& p) { p.softmax_scale = std::numeric_limits<float>::quiet_NaN(); },
       "softmax_scale"},
      {[](AttentionParams& p) { p.softmax_scale = std::numeric_limits<float>::infinity(); },
       "softmax_scale"},
  };
  for (const Case& c : cases) {
    AttentionParams p = good;
    c.mutate(p);
    const std::string message = cpu::supported(p);
    EXPECT_NE(message.find(c.expected), std::string::npos)
        << "got '" << message << "', want '" << c.expected << "'";
  }
}

TEST(ThreadPool, CoversEveryIndexExactlyOnce) {
  for (int threads : {1, 2, 4}) {
    cpu::ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (int64_t n : {0, 1, 2, 3, 17, 1000, 100003}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_for(n, [&](int64_t i) { hits[i].fetch_add(1); });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " index " << i;
    }
  }
  EXPECT_GE(cpu::ThreadPool(0).num_threads(), 1);
}

TEST(ThreadPool, ConcurrentCallersShareWorkers) {
  cpu::ThreadPool pool(3);
  constexpr int kCallers = 4, kRounds = 200, kN = 257;
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  std::atomic<int> wrong{0};
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&] {
      for (int round = 0; round < kRounds; ++round) {
        std::vector<std::atomic<int>> hits(kN);
        pool.parallel_for(kN, [&](int64_t i) {
          hits[i].fetch_add(1);
          total.fetch_add(1);
        });
        for (auto& h : hits) wrong += h.load() != 1;  // parallel_for returned only after all calls
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(total.load(), int64_t{kCallers} * kRounds * kN);
}

TEST(ThreadPool, NestedParallelForCompletes) {
  cpu::ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.parallel_for(8,
                    [&](int64_t) { pool.parallel_for(16, [&](int64_t) { count.fetch_add(1); }); });
  EXPECT_EQ(count.load(), 8 * 16);
}

// Under an address-space limit with room for a few thread stacks (8 MiB each), not 1000: a pool
// of 1000 threads runs a parallel_for with the ones that started. Exits 0 when it did.
[[noreturn]] void PoolOfThreadsThatCannotAllStart() {
  std::ifstream statm("/proc/self/statm");
  long pages = 0;
  statm >> pages;
  rlimit as{};
  as.rlim_cur = as.rlim_max = rlim_t(pages) * rlim_t(sysconf(_SC_PAGESIZE)) + (rlim_t{64} << 20);
  if (pages <= 0 || setrlimit(RLIMIT_AS, &as) != 0) std::_Exit(3);
  cpu::ThreadPool pool(1000);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(1000, [&](int64_t i) { sum.fetch_add(i); });
  const bool fewer = pool.num_threads() >= 1 && pool.num_threads() < 1000;
  std::_Exit(fewer && sum.load() == 999 * 1000 / 2 ? 0 : 4);
}

// Threads that cannot start are left out of the pool; the std::system_error of the first one
// ended the process (std::terminate), e.g. the server's at --worker_threads=100000.
TEST(ThreadPoolDeathTest, ThreadsThatCannotStartAreLeftOut) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "an address-space limit breaks the sanitizer's shadow memory";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(PoolOfThreadsThatCannotAllStart(), testing::ExitedWithCode(0), "");
}

// --- the references themselves ------------------------------------------------------------

TEST(ReferenceAttention, SingleKeyReturnsItsValue) {
  const int d = 5;
  std::vector<float> q = {1, 2, 3, 4, 5}, k = {0.5f, -1, 0.25f, 2, 1}, v = {3, -2, 0.5f, 7, 1};
  AttentionParams p = make_contiguous_params(DType::kFloat32, 1, 1, 1, 1, 1, d, false, 0.5f);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  std::vector<double> o, lse;
  for (auto* fn : {&reference::attention_fp64, &reference::attention_emulated}) {
    fn(p, &o, &lse);
    for (int c = 0; c < d; ++c) EXPECT_EQ(o[c], v[c]);
    EXPECT_NEAR(lse[0], 0.5 * (0.5 - 2 + 0.75 + 8 + 5), 1e-6);
  }
}

TEST(ReferenceAttention, ZeroQueryAveragesValuesAndMasksCausally) {
  const int sk = 4, sq = 6;  // causal, Sq > Sk: rows 0 and 1 see nothing, row i sees i - 1 keys
  std::vector<float> q(sq, 0.f), k(sk, 1.f), v = {1, 2, 4, 8};
  AttentionParams p = make_contiguous_params(DType::kFloat32, 1, sq, sk, 1, 1, 1, true, 1.f);
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  std::vector<double> o, lse;
  reference::attention_fp64(p, &o, &lse);
  const double expected[] = {0, 0, 1, 1.5, 7.0 / 3, 3.75};
  for (int i = 0; i < sq; ++i) {
    EXPECT_DOUBLE_EQ(o[i], expected[i]) << i;
    EXPECT_EQ(lse[i], i < 2 ? -kInf : std::log(double(i - 1))) << i;
  }
}

// Emulated vs fp64: the emulation rounds P (relative u each, so at most u * max|V| on O) and
// the output (u * |O|), on top of fp32 arithmetic. It must also differ at all in 16-bit dtypes.
TEST(ReferenceAttention, EmulatedIsCloseToFp64AtDtypePrecision) {
  for (DType dtype : kAllDtypes) {
    const uint32_t seed = fresh_seed();
    const Shape s{2, 50, 120, 4, 2, 64, true};
    SCOPED_TRACE(describe(s, dtype) + " seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    Problem t(s, dtype, rng);
    std::vector<double> ref_o, ref_lse, emu_o, emu_lse;
    reference::attention_fp64(t.p, &ref_o, &ref_lse);
    reference::attention_emulated(t.p, &emu_o, &emu_lse);
    double max_v = 0;
    for (int64_t i = 0; i < int64_t(t.kv.size() * 2 / dtype_size(dtype)); ++i) {
      const float x = load_element(t.kv.data(), i, dtype);
      if (!std::isnan(x)) max_v = std::max<double>(max_v, std::abs(x));
    }
    const double u = unit_roundoff(dtype);
    const double fp32_slack = kFp32Slack * max_abs(ref_o);
    double worst = 0;
    for (size_t i = 0; i < ref_o.size(); ++i) {
      const double err = std::abs(emu_o[i] - ref_o[i]);
      worst = std::max(worst, err);
      ASSERT_LE(err, u * (std::abs(ref_o[i]) + max_v) + fp32_slack) << i;
    }
    for (size_t i = 0; i < ref_lse.size(); ++i) {
      if (ref_lse[i] == -kInf) {
        EXPECT_EQ(emu_lse[i], -kInf);
      } else {
        EXPECT_NEAR(emu_lse[i], ref_lse[i], kFp32Slack * (1 + std::abs(ref_lse[i])));
      }
    }
    if (dtype != DType::kFloat32) {
      EXPECT_GT(worst, u * 1e-3) << "the emulation should round something";
    }
  }
}

// EmulationOptions: one block covering every key is the default emulation exactly; the kernel's
// blocks with a lazy rescale (P against a stale max, up to 2^8) round differently but stay
// within the same dtype bound against fp64.
TEST(ReferenceAttention, EmulationOptionsFollowTheKernelsBlocks) {
  const uint32_t seed = fresh_seed();
  const Shape s{1, 40, 300, 2, 1, 64, true, false, 0.f, 3.f};  // large logits: the max moves
  const DType dtype = DType::kBFloat16;
  SCOPED_TRACE(describe(s, dtype) + " seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  Problem t(s, dtype, rng);
  std::vector<double> ref_o, ref_lse, emu_o, emu_lse, one_o, one_lse, exact_o, exact_lse, lazy_o,
      lazy_lse;
  reference::attention_fp64(t.p, &ref_o, &ref_lse);
  reference::attention_emulated(t.p, &emu_o, &emu_lse);
  reference::EmulationOptions one_block;
  one_block.block_n = 512;
  reference::attention_emulated(t.p, one_block, &one_o, &one_lse);
  EXPECT_EQ(one_o, emu_o);
  EXPECT_EQ(one_lse, emu_lse);

  reference::EmulationOptions exact;
  exact.block_n = 64;
  reference::EmulationOptions lazy = exact;
  lazy.rescale_threshold_log2 = 8.f;
  reference::attention_emulated(t.p, exact, &exact_o, &exact_lse);
  reference::attention_emulated(t.p, lazy, &lazy_o, &lazy_lse);
  EXPECT_NE(lazy_o, exact_o) << "a stale max should change how some P rounds";
  double max_v = 0;
  for (int64_t i = 0; i < int64_t(t.kv.size()); ++i)
    max_v = std::max<double>(max_v, std::abs(load_element(t.kv.data(), i, dtype)));
  const double u = unit_roundoff(dtype);
  const double fp32_slack = kFp32Slack * max_abs(ref_o);
  for (const auto* o : {&exact_o, &lazy_o}) {
    for (size_t i = 0; i < ref_o.size(); ++i) {
      ASSERT_LE(std::abs((*o)[i] - ref_o[i]), u * (std::abs(ref_o[i]) + max_v) + fp32_slack) << i;
    }
  }
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    if (ref_lse[i] != -kInf) {
      EXPECT_NEAR(lazy_lse[i], ref_lse[i], kFp32Slack * (1 + std::abs(ref_lse[i])));
    }
  }
}

}  // namespace
}  // namespace flashserve::kernels
