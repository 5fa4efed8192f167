// expected_length: an Append or DecodeStep retried after a lost answer appends its rows once, and
// a length the client did not expect refuses the whole call (ABORTED, nothing appended).
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"
#include "runtime/cpu_kv_store.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::DenseLayer;
using testing::RandomRows;
using testing::Rows;

constexpr DType kDtype = DType::kBFloat16;
constexpr int kHeadsQ = 4, kHeadsKv = 2, kDim = 64;

class ExpectedLengthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = std::make_unique<kernels::cpu::ThreadPool>(2);
    store_ = *CpuKvStore::Create(4 << 20, pool_.get());
    KvCacheOptions options;
    options.capacity_bytes = 4 << 20;
    options.page_tokens = 5;  // rows straddle pages
    cache_ = *SequenceCache::Create(options, store_.get(), nullptr);
    shape_.num_layers = 2;
    shape_.heads_q = kHeadsQ;
    shape_.heads_kv = kHeadsKv;
    shape_.head_dim = kDim;
    shape_.dtype = kDtype;
  }

  std::string Create() {
    CreateRequest request;
    request.shape = shape_;
    return cache_->CreateSequence(request)->id;
  }
  Bits KvRows(int rows) { return RandomRows(&rng_, rows, kHeadsKv, kDim, kDtype); }
  HostRows KvOf(const Bits& bits) { return Rows(bits, kHeadsKv, kDim, kDtype); }
  std::vector<int64_t> Lengths(const std::string& id) { return cache_->Info(id)->lengths; }

  // Runs one step item over the plan and checks O against the fp64 reference over `dense`.
  void AttendAndCheck(StepPlan* plan, size_t i, const Bits& q, const DenseLayer& dense) {
    Bits out(q.size(), 0x7fc0);  // poisoned: NaN
    std::vector<float> lse(kHeadsQ, NAN);
    plan->batch.softmax_scale = 0.125f;
    for (PagedItem& item : plan->batch.items) item.out = nullptr;
    plan->batch.items[i].out = out.data();
    plan->batch.items[i].lse = lse.data();
    PagedBatch one = plan->batch;
    one.items = {plan->batch.items[i]};
    AttendInfo info;
    ASSERT_TRUE(store_->Attend(one, &info).ok());
    testing::CheckAgainstReference(shape_, dense, q, 1, false, 0.125f, out, lse, "retried step");
  }

  std::mt19937 rng_{20261129};
  SequenceShape shape_;
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<CpuKvStore> store_;
  std::unique_ptr<SequenceCache> cache_;
};

TEST_F(ExpectedLengthTest, RetriedAppendAppendsOnce) {
  const std::string id = Create();
  const Bits k = KvRows(3), v = KvRows(3);
  LayerRows rows{1, KvOf(k), KvOf(v), 0};
  absl::StatusOr<AppendResult> first = cache_->Append(id, {rows});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->lengths, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(first->already_appended.empty());
  absl::StatusOr<AppendResult> again = cache_->Append(id, {rows});  // the answer was lost
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->lengths, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(again->already_appended, std::vector<int>{1});
  // Unchecked, the same rows append again (the old behaviour, and what the field prevents).
  rows.expected_length = -1;
  EXPECT_EQ(cache_->Append(id, {rows})->lengths, (std::vector<int64_t>{0, 6}));
}

TEST_F(ExpectedLengthTest, UnexpectedLengthAbortsTheWholeAppend) {
  const std::string id = Create();
  const Bits k = KvRows(2), v = KvRows(2);
  ASSERT_TRUE(cache_->Append(id, {{0, KvOf(k), KvOf(v), -1}}).ok());  // layer 0: 2 tokens
  for (int64_t expected : {int64_t{1}, int64_t{3}, int64_t{5}}) {     // 0 and 2 are the valid ones
    absl::StatusOr<AppendResult> r =
        cache_->Append(id, {{1, KvOf(k), KvOf(v), 0}, {0, KvOf(k), KvOf(v), expected}});
    ASSERT_EQ(r.status().code(), absl::StatusCode::kAborted) << expected;
    EXPECT_NE(r.status().message().find("layer 0 holds 2 tokens but the call expected " +
                                        std::to_string(expected)),
              std::string::npos)
        << r.status();
    EXPECT_EQ(Lengths(id), (std::vector<int64_t>{2, 0})) << "layer 1 appended by a refused call";
  }
  // No rows: the length must be exactly the expected one.
  const Bits none;
  EXPECT_EQ(cache_->Append(id, {{0, KvOf(none), KvOf(none), 1}}).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_TRUE(cache_->Append(id, {{0, KvOf(none), KvOf(none), 2}}).ok());
}

// A step retried after its answer was lost: the rows are there once, q attends over them, and
// the result is the reference's over the cache as the first try left it.
TEST_F(ExpectedLengthTest, RetriedStepAttendsWithoutAppendingAgain) {
  const std::string a = Create(), b = Create();
  DenseLayer dense_a;
  const Bits prefix_k = KvRows(4), prefix_v = KvRows(4);
  ASSERT_TRUE(cache_->Append(a, {{0, KvOf(prefix_k), KvOf(prefix_v), 0}}).ok());
  dense_a.Append(prefix_k, prefix_v);
  const Bits q = RandomRows(&rng_, 1, kHeadsQ, kDim, kDtype);
  const Bits k = KvRows(1), v = KvRows(1);
  const Bits kb = KvRows(1), vb = KvRows(1);
  std::vector<StepItem> items = {{a, 0, Rows(q, kHeadsQ, kDim, kDtype), KvOf(k), KvOf(v), 4},
                                 {b, 0, Rows(q, kHeadsQ, kDim, kDtype), KvOf(kb), KvOf(vb), 0}};
  {
    absl::StatusOr<StepPlan> first = cache_->PrepareStep(items);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(first->already_appended, (std::vector<bool>{false, false}));
  }
  dense_a.Append(k, v);
  absl::StatusOr<StepPlan> retry = cache_->PrepareStep(items);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->already_appended, (std::vector<bool>{true, true}));
  EXPECT_EQ(retry->batch.items[0].length, 5);
  EXPECT_EQ(retry->batch.items[1].length, 1);
  AttendAndCheck(&*retry, 0, q, dense_a);
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{5, 0}));
}

TEST_F(ExpectedLengthTest, UnexpectedLengthAbortsTheWholeStep) {
  const std::string a = Create(), b = Create();
  const Bits q = RandomRows(&rng_, 1, kHeadsQ, kDim, kDtype);
  const Bits k = KvRows(2), v = KvRows(2);
  const HostRows qr = Rows(q, kHeadsQ, kDim, kDtype);
  // Item 0 is fine; item 1 expects 3 tokens where layer 1 of b holds 0 (and 0 + 2 != 3).
  absl::StatusOr<StepPlan> plan =
      cache_->PrepareStep({{a, 0, qr, KvOf(k), KvOf(v), 0}, {b, 1, qr, KvOf(k), KvOf(v), 3}});
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kAborted) << plan.status();
  EXPECT_NE(plan.status().message().find("item 1: layer 1 holds 0 tokens"), std::string::npos)
      << plan.status();
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{0, 0})) << "item 0 appended by a refused step";
  // Unset (-1) is unchecked, as before the field existed.
  EXPECT_TRUE(cache_->PrepareStep({{a, 0, qr, KvOf(k), KvOf(v), -1}}).ok());
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{2, 0}));
}

}  // namespace
}  // namespace flashserve::kvcache
