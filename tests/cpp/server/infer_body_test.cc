// edge/http/infer_body: the KServe REST body reader gives the same request whatever pieces the body
// arrives in -- with a small JSON header (parsed as soon as it is whole) and a large one (binary
// bytes stashed until the parse, off the listener thread) -- and gives its budget back.
#include "edge/http/infer_body.h"

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

struct Body {
  std::string text;
  int64_t header_length = 0;
  std::vector<float> q;
  std::string k_bytes, v_bytes;
};

// q [1, seqlen_q, 2, 64] as JSON numbers, k and v [1, 29, 2, 64] as binary inputs after it.
Body MakeBody(int seqlen_q, std::mt19937* rng) {
  std::uniform_int_distribution<int> value(-4096, 4096);
  Body body;
  std::string q_text;
  for (int i = 0; i < seqlen_q * 2 * 64; ++i) {
    body.q.push_back(float(value(*rng)) / 8.f);  // exact in fp32 and in 6 significant digits
    absl::StrAppend(&q_text, i ? "," : "", body.q.back());
  }
  for (std::string* bytes : {&body.k_bytes, &body.v_bytes}) {
    std::vector<float> x(29 * 2 * 64);
    for (float& f : x) f = float(value(*rng)) / 8.f;
    bytes->assign(reinterpret_cast<const char*>(x.data()), x.size() * sizeof(float));
  }
  const std::string header = absl::StrCat(
      R"({"inputs":[{"name":"Q","datatype":"FP32","shape":[1,)", seqlen_q, R"(,2,64],"data":[)",
      q_text, R"(]},{"name":"K","datatype":"FP32","shape":[1,29,2,64],"parameters":{"binary_data_size":)",
      body.k_bytes.size(),
      R"(}},{"name":"V","datatype":"FP32","shape":[1,29,2,64],"parameters":{"binary_data_size":)",
      body.v_bytes.size(), "}}]}");
  body.header_length = int64_t(header.size());
  body.text = header + body.k_bytes + body.v_bytes;
  return body;
}

ValidationLimits CpuLimits() {
  ValidationLimits limits;
  limits.dtypes = {kernels::DType::kFloat16, kernels::DType::kBFloat16, kernels::DType::kFloat32};
  return limits;
}

struct Reader {
  Reader(const Body& body, bool chunked, std::shared_ptr<ReceiveBudget> budget)
      : hold(budget),
        reader(body.header_length, chunked ? -1 : int64_t(body.text.size()), Limits(budget),
               &validation, &hold) {}
  static KServeRestLimits Limits(std::shared_ptr<ReceiveBudget> budget) {
    KServeRestLimits limits;
    limits.budget = std::move(budget);
    return limits;
  }
  ValidationLimits validation = CpuLimits();
  BudgetHold hold;
  InferBodyReader reader;
};

// Feeds `text` in pieces of random sizes (1 byte to 64 KiB).
absl::Status FeedInPieces(const std::string& text, InferBodyReader* reader, std::mt19937* rng) {
  std::uniform_int_distribution<size_t> piece(1, 65536);
  for (size_t at = 0; at < text.size();) {
    const size_t n = std::min(piece(*rng), text.size() - at);
    if (absl::Status s = reader->Consume(text.data() + at, n); !s.ok()) return s;
    at += n;
  }
  return absl::OkStatus();
}

void ExpectTheRequestOf(const Body& body, InferBodyReader* reader) {
  const v1::AttentionRequest& request = reader->request().request;
  ASSERT_EQ(request.q().data().size(), body.q.size() * sizeof(float));
  EXPECT_EQ(std::memcmp(request.q().data().data(), body.q.data(), body.q.size() * sizeof(float)), 0);
  EXPECT_EQ(request.k().data(), body.k_bytes);
  EXPECT_EQ(request.v().data(), body.v_bytes);
}

TEST(InferBodyReader, TheSameRequestWhateverThePiecesSmallAndLargeHeaders) {
  std::mt19937 rng(std::random_device{}());
  auto budget = std::make_shared<ReceiveBudget>(int64_t{1} << 30);
  for (const int seqlen_q : {3, 777}) {  // a header of ~2 KB (inline) and of ~500 KB (stashed)
    const Body body = MakeBody(seqlen_q, &rng);
    const bool large = body.header_length >= kInlineJsonParseBytes;
    EXPECT_EQ(large, seqlen_q == 777) << body.header_length;
    for (const bool chunked : {false, true}) {
      for (int round = 0; round < 8; ++round) {
        Reader r(body, chunked, budget);
        ASSERT_TRUE(r.reader.CheckHeaderLength().ok());
        ASSERT_TRUE(FeedInPieces(body.text, &r.reader, &rng).ok());
        EXPECT_EQ(r.reader.ParsesLater(), large);
        const int64_t before = r.hold.held();
        const absl::Status finished = r.reader.Finish();
        ASSERT_TRUE(finished.ok()) << finished;
        ExpectTheRequestOf(body, &r.reader);
        if (large) {
          // The stash's bytes went back as the tensors took theirs: what grew is the answer's.
          const AnswerElements answer = AnswerElementsOf(r.reader.request());
          EXPECT_EQ(r.hold.held() - before,
                    answer.binary_bytes + answer.json * kJsonAnswerBytesPerElement);
        }
      }
    }
  }
  EXPECT_EQ(budget->used(), 0);  // every hold gave back what it took
}

TEST(InferBodyReader, AStashedBodyWithTheWrongBinaryBytesIsRefused) {
  std::mt19937 rng(std::random_device{}());
  const Body body = MakeBody(777, &rng);
  auto budget = std::make_shared<ReceiveBudget>(int64_t{1} << 30);
  for (const int cut : {-1, 1}) {  // chunked: nothing else tells the reader where the body ends
    const std::string text = cut < 0 ? body.text.substr(0, body.text.size() - 1) : body.text + "x";
    Reader r(body, /*chunked=*/true, budget);
    ASSERT_TRUE(FeedInPieces(text, &r.reader, &rng).ok());
    ASSERT_TRUE(r.reader.ParsesLater());
    const absl::Status s = r.reader.Finish();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  }
  EXPECT_EQ(budget->used(), 0);
}

TEST(InferBodyReader, TheStashCountsAgainstTheBudget) {
  std::mt19937 rng(std::random_device{}());
  const Body body = MakeBody(777, &rng);
  // Room for the header and half the binary bytes: the stash must stop there (503), not grow.
  auto budget = std::make_shared<ReceiveBudget>(body.header_length + int64_t(body.k_bytes.size()));
  Reader r(body, /*chunked=*/false, budget);
  const absl::Status s = FeedInPieces(body.text, &r.reader, &rng);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_LE(budget->used(), budget->limit());
}

}  // namespace
}  // namespace flashserve
