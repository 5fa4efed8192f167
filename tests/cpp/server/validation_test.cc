// Table of malformed requests: each bad field gets the expected code and a message naming it.
#include "api/validation.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using kernels::DType;

void SetTensor(v1::Tensor* t, v1::DType dtype, std::vector<int64_t> shape) {
  t->set_dtype(dtype);
  t->clear_shape();
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  const int64_t size = dtype == v1::FLOAT32 ? 4 : 2;
  t->set_data(std::string(size_t(n * size), '\x11'));
}

// A valid request: q [2, 5, 4, 64], k/v [2, 7, 2, 64], fp16.
v1::AttentionRequest GoodRequest() {
  v1::AttentionRequest r;
  SetTensor(r.mutable_q(), v1::FLOAT16, {2, 5, 4, 64});
  SetTensor(r.mutable_k(), v1::FLOAT16, {2, 7, 2, 64});
  SetTensor(r.mutable_v(), v1::FLOAT16, {2, 7, 2, 64});
  return r;
}

ValidationLimits CpuLimits() {
  ValidationLimits limits;
  limits.dtypes = {DType::kFloat16, DType::kBFloat16, DType::kFloat32};
  limits.max_head_dim = 256;
  limits.max_tensor_elements = 1 << 20;
  limits.backend_name = "cpu";
  return limits;
}

struct BadCase {
  const char* name;
  std::function<void(v1::AttentionRequest*)> mutate;
  absl::StatusCode code;
  const char* fragment;
};

class ValidationBadInput : public testing::TestWithParam<BadCase> {};

TEST_P(ValidationBadInput, NamesTheField) {
  const BadCase& c = GetParam();
  v1::AttentionRequest request = GoodRequest();
  c.mutate(&request);
  absl::StatusOr<AttentionProblem> result = ValidateAttentionRequest(request, CpuLimits());
  ASSERT_FALSE(result.ok()) << c.name;
  EXPECT_EQ(result.status().code(), c.code) << result.status();
  EXPECT_NE(result.status().message().find(c.fragment), std::string::npos)
      << "message \"" << result.status().message() << "\" lacks \"" << c.fragment << "\"";
}

const auto kInvalid = absl::StatusCode::kInvalidArgument;

INSTANTIATE_TEST_SUITE_P(
    Table, ValidationBadInput,
    testing::Values(
        BadCase{"q missing", [](auto* r) { r->clear_q(); }, kInvalid, "q: missing"},
        BadCase{"v missing", [](auto* r) { r->clear_v(); }, kInvalid, "v: missing"},
        BadCase{"q dtype unspecified",
                [](auto* r) { r->mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED); }, kInvalid,
                "q.dtype: unspecified"},
        BadCase{"k dtype unknown",
                [](auto* r) { r->mutable_k()->set_dtype(static_cast<v1::DType>(7)); }, kInvalid,
                "k.dtype: unknown value 7"},
        BadCase{"mixed dtypes",
                [](auto* r) {
                  SetTensor(r->mutable_k(), v1::BFLOAT16, {2, 7, 2, 64});
                },
                kInvalid, "k.dtype: BFLOAT16 differs from q.dtype FLOAT16"},
        BadCase{"q rank 3",
                [](auto* r) {
                  SetTensor(r->mutable_q(), v1::FLOAT16, {2, 5, 256});
                },
                kInvalid, "q.shape: expected rank 4"},
        BadCase{"k rank 5",
                [](auto* r) {
                  SetTensor(r->mutable_k(), v1::FLOAT16, {2, 7, 2, 8, 8});
                },
                kInvalid, "k.shape: expected rank 4"},
        BadCase{"zero seqlen_q", [](auto* r) { r->mutable_q()->set_shape(1, 0); }, kInvalid,
                "q.shape[1] (seqlen_q) must be > 0, got 0"},
        BadCase{"negative heads_kv", [](auto* r) { r->mutable_k()->set_shape(2, -2); }, kInvalid,
                "k.shape[2] (heads_kv) must be > 0, got -2"},
        BadCase{"dim over int32", [](auto* r) { r->mutable_v()->set_shape(1, int64_t{1} << 31); },
                kInvalid, "v.shape[1] (seqlen_k) = 2147483648 exceeds"},
        BadCase{"element count overflows int64",
                [](auto* r) {
                  auto* q = r->mutable_q();
                  for (int i = 0; i < 4; ++i) q->set_shape(i, 2000000000);
                },
                kInvalid, "q.shape: element count"},
        BadCase{"over max_tensor_elements",
                [](auto* r) {
                  SetTensor(r->mutable_q(), v1::FLOAT16, {1, 1, 1, 1});
                  r->mutable_q()->set_shape(1, 1 << 20);
                  r->mutable_q()->set_shape(3, 64);
                },
                absl::StatusCode::kResourceExhausted, "max_tensor_elements"},
        BadCase{"batch differs",
                [](auto* r) {
                  SetTensor(r->mutable_k(), v1::FLOAT16, {3, 7, 2, 64});
                },
                kInvalid, "k.shape[0] (batch) = 3 differs"},
        BadCase{"head_dim differs",
                [](auto* r) {
                  SetTensor(r->mutable_k(), v1::FLOAT16, {2, 7, 2, 32});
                },
                kInvalid, "k.shape[3] (head_dim)"},
        BadCase{"v shape differs",
                [](auto* r) {
                  SetTensor(r->mutable_v(), v1::FLOAT16, {2, 8, 2, 64});
                },
                kInvalid, "v.shape [2, 8, 2, 64] must equal k.shape"},
        BadCase{"heads not a multiple",
                [](auto* r) {
                  SetTensor(r->mutable_q(), v1::FLOAT16, {2, 5, 6, 64});
                  SetTensor(r->mutable_k(), v1::FLOAT16, {2, 7, 4, 64});
                  SetTensor(r->mutable_v(), v1::FLOAT16, {2, 7, 4, 64});
                },
                kInvalid, "must be a multiple of k.shape[2] (heads_kv) = 4"},
        BadCase{"q data short", [](auto* r) { r->mutable_q()->mutable_data()->pop_back(); },
                kInvalid, "q.data: expected 5120 bytes"},
        BadCase{"v data long", [](auto* r) { r->mutable_v()->mutable_data()->append("xy"); },
                kInvalid, "v.data: expected 3584 bytes"},
        BadCase{"head_dim over CPU max",
                [](auto* r) {
                  SetTensor(r->mutable_q(), v1::FLOAT16, {1, 1, 1, 300});
                  SetTensor(r->mutable_k(), v1::FLOAT16, {1, 1, 1, 300});
                  SetTensor(r->mutable_v(), v1::FLOAT16, {1, 1, 1, 300});
                },
                kInvalid, "head_dim: 300 is not supported by the cpu backend (max 256)"},
        BadCase{"scale zero", [](auto* r) { r->set_softmax_scale(0.f); }, kInvalid,
                "softmax_scale: must be finite, > 0"},
        BadCase{"scale negative", [](auto* r) { r->set_softmax_scale(-1.f); }, kInvalid,
                "softmax_scale"},
        BadCase{"scale NaN",
                [](auto* r) { r->set_softmax_scale(std::numeric_limits<float>::quiet_NaN()); },
                kInvalid, "softmax_scale"},
        BadCase{"scale inf",
                [](auto* r) { r->set_softmax_scale(std::numeric_limits<float>::infinity()); },
                kInvalid, "softmax_scale"}),
    [](const testing::TestParamInfo<BadCase>& param_info) {
      std::string name = param_info.param.name;
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

TEST(Validation, EmptyRequestNamesQ) {
  absl::StatusOr<AttentionProblem> result = ValidateAttentionRequest({}, CpuLimits());
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), kInvalid);
  EXPECT_TRUE(absl::StartsWith(result.status().message(), "q: missing"));
}

TEST(Validation, UnsupportedDTypeForBackend) {
  ValidationLimits limits = CpuLimits();
  limits.dtypes = {DType::kFloat16, DType::kBFloat16};
  limits.backend_name = "cuda";
  v1::AttentionRequest r = GoodRequest();
  SetTensor(r.mutable_q(), v1::FLOAT32, {2, 5, 4, 64});
  SetTensor(r.mutable_k(), v1::FLOAT32, {2, 7, 2, 64});
  SetTensor(r.mutable_v(), v1::FLOAT32, {2, 7, 2, 64});
  absl::StatusOr<AttentionProblem> result = ValidateAttentionRequest(r, limits);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().message(),
            "q.dtype: FLOAT32 is not supported by the cuda backend (supported: FLOAT16, BFLOAT16)");
}

// The CUDA kernels' grid limit on batch and heads_q is checked with the rest, before anything is
// allocated (the CUDA backend refused such a request only after its device buffers were).
TEST(Validation, BatchAndHeadsWithinTheBackendsLimit) {
  ValidationLimits limits = CpuLimits();
  limits.backend_name = "cuda";
  limits.max_tensor_elements = int64_t{1} << 40;
  limits.max_batch_and_heads = 65535;
  // Shapes [batch, 1, heads_q, 8] against K/V of one head, their data held outside the message.
  auto validate = [&](int64_t batch, int64_t heads_q) {
    v1::AttentionRequest r;
    for (auto [t, heads] : {std::pair{r.mutable_q(), heads_q}, std::pair{r.mutable_k(), int64_t{1}},
                            std::pair{r.mutable_v(), int64_t{1}}}) {
      t->set_dtype(v1::FLOAT16);
      for (int64_t d : {batch, int64_t{1}, heads, int64_t{8}}) t->add_shape(d);
    }
    const int64_t bytes[3] = {batch * heads_q * 16, batch * 16, batch * 16};
    return ValidateAttentionRequest(r, limits, bytes);
  };
  absl::StatusOr<AttentionProblem> result = validate(65536, 4);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().message(),
            "q.shape: batch 65536 exceeds the cuda backend's limit of 65535 (split the request)");
  result = validate(1, 65536);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("heads_q 65536 exceeds"), std::string::npos)
      << result.status();
  EXPECT_TRUE(validate(65535, 65535).ok()) << validate(65535, 65535).status();
  limits.max_batch_and_heads = 0;  // the CPU backend: none
  EXPECT_TRUE(validate(65536, 4).ok());
}

TEST(Validation, HeadDimListed) {
  ValidationLimits limits = CpuLimits();
  limits.head_dims = {64, 128};
  limits.backend_name = "cuda";
  v1::AttentionRequest r = GoodRequest();
  SetTensor(r.mutable_q(), v1::FLOAT16, {2, 5, 4, 96});
  SetTensor(r.mutable_k(), v1::FLOAT16, {2, 7, 2, 96});
  SetTensor(r.mutable_v(), v1::FLOAT16, {2, 7, 2, 96});
  absl::StatusOr<AttentionProblem> result = ValidateAttentionRequest(r, limits);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().message(),
            "head_dim: 96 is not supported by the cuda backend (supported: 64, 128)");
  EXPECT_TRUE(ValidateAttentionRequest(GoodRequest(), limits).ok());
}

TEST(Validation, GoodRequestYieldsProblem) {
  v1::AttentionRequest r = GoodRequest();
  r.set_causal(true);
  r.set_return_lse(true);
  absl::StatusOr<AttentionProblem> p = ValidateAttentionRequest(r, CpuLimits());
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->batch, 2);
  EXPECT_EQ(p->seqlen_q, 5);
  EXPECT_EQ(p->heads_q, 4);
  EXPECT_EQ(p->seqlen_k, 7);
  EXPECT_EQ(p->heads_kv, 2);
  EXPECT_EQ(p->head_dim, 64);
  EXPECT_TRUE(p->causal);
  EXPECT_TRUE(p->return_lse);
  EXPECT_FLOAT_EQ(p->softmax_scale, 0.125f);
  EXPECT_EQ(p->lse_elements(), 2 * 4 * 5);
}

TEST(Validation, ExplicitScaleKept) {
  v1::AttentionRequest r = GoodRequest();
  r.set_softmax_scale(0.5f);
  absl::StatusOr<AttentionProblem> p = ValidateAttentionRequest(r, CpuLimits());
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->softmax_scale, 0.5f);
}

TEST(Validation, LimitIsInclusive) {
  ValidationLimits limits = CpuLimits();
  limits.max_tensor_elements = 2 * 5 * 4 * 64;  // exactly q's size; k and v are smaller
  EXPECT_TRUE(ValidateAttentionRequest(GoodRequest(), limits).ok());
  limits.max_tensor_elements -= 1;
  absl::StatusOr<AttentionProblem> p = ValidateAttentionRequest(GoodRequest(), limits);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StartsWith(p.status().message(), "q: 2560 elements exceed"));
}

}  // namespace
}  // namespace flashserve

namespace flashserve {
namespace {

TEST(Validation, ScaleAboveTheMaximumIsRefused) {
  // Far past any real model's scale, fp32 logits overflow for ordinary inputs (NaN rows).
  v1::AttentionRequest r = GoodRequest();
  for (float scale : {3e38f, 2.3e38f, 1e5f, 10000.5f}) {
    r.set_softmax_scale(scale);
    absl::StatusOr<AttentionProblem> p = ValidateAttentionRequest(r, CpuLimits());
    ASSERT_FALSE(p.ok()) << scale;
    EXPECT_TRUE(absl::StartsWith(p.status().message(),
                                 "softmax_scale: must be finite, > 0 and <= 10000, got "))
        << p.status();
  }
  r.set_softmax_scale(kMaxSoftmaxScale);
  EXPECT_TRUE(ValidateAttentionRequest(r, CpuLimits()).ok());
}

TEST(Validation, HugeRankMessageStaysShort) {
  v1::AttentionRequest r = GoodRequest();
  for (int i = 0; i < 100000; ++i) r.mutable_q()->add_shape(1);
  absl::StatusOr<AttentionProblem> p = ValidateAttentionRequest(r, CpuLimits());
  ASSERT_FALSE(p.ok());
  EXPECT_TRUE(absl::StartsWith(p.status().message(), "q.shape: expected rank 4")) << p.status();
  EXPECT_LT(p.status().message().size(), 300u);
}

}  // namespace
}  // namespace flashserve
