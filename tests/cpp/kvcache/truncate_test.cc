// Truncate: speculative decoding appends draft tokens, keeps those the model accepted and cuts the
// rest; later steps attend over exactly the kept rows (fp64 reference), pages past the cut go back
// to the pool, and the call is all or nothing, safe to retry and never cuts under a running step.
#include <future>
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

constexpr DType kDtype = DType::kFloat16;
constexpr int kHeadsQ = 6, kHeadsKv = 2, kDim = 32, kPageTokens = 5;
constexpr float kScale = 0.2f;

class TruncateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = std::make_unique<kernels::cpu::ThreadPool>(2);
    store_ = *CpuKvStore::Create(4 << 20, pool_.get());
    KvCacheOptions options;
    options.capacity_bytes = 4 << 20;
    options.page_tokens = kPageTokens;  // drafts straddle pages
    cache_ = *SequenceCache::Create(options, store_.get(), nullptr);
    shape_ = {2, kHeadsQ, kHeadsKv, kDim, kDtype};
  }

  // A sequence whose layers start with `prefix` random rows each (mirrored in (*dense)[layer]).
  std::string Create(int prefix, std::vector<DenseLayer>* dense) {
    CreateRequest request;
    request.shape = shape_;
    dense->assign(2, DenseLayer{});
    keep_.clear();
    for (int layer = 0; layer < 2; ++layer) {
      keep_.push_back(KvRows(prefix));
      keep_.push_back(KvRows(prefix));
      const Bits& k = keep_[keep_.size() - 2];
      const Bits& v = keep_.back();
      request.prefix.push_back({layer, KvOf(k), KvOf(v), -1});
      (*dense)[size_t(layer)].Append(k, v);
    }
    absl::StatusOr<SequenceStatus> created = cache_->CreateSequence(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created->id;
  }
  Bits KvRows(int rows) { return RandomRows(&rng_, rows, kHeadsKv, kDim, kDtype); }
  HostRows KvOf(const Bits& bits) { return Rows(bits, kHeadsKv, kDim, kDtype); }
  std::vector<int64_t> Lengths(const std::string& id) { return cache_->Info(id)->lengths; }
  // A Truncate of one sequence.
  absl::StatusOr<TruncateResult> Cut(const std::string& id, int64_t length, std::vector<int> layers,
                                     absl::Time deadline = absl::InfiniteFuture()) {
    absl::StatusOr<std::vector<TruncateResult>> r =
        cache_->Truncate({{id, length, std::move(layers)}}, deadline);
    if (!r.ok()) return r.status();
    EXPECT_EQ(r->size(), 1u);
    return r->front();
  }

  // A prepared step appending 2 rows to layer 0: it pins `id` until the plan is destroyed.
  std::unique_ptr<StepPlan> PinWithAStep(const std::string& id) {
    pin_q_ = RandomRows(&rng_, 2, kHeadsQ, kDim, kDtype);
    pin_k_ = KvRows(2);
    pin_v_ = KvRows(2);
    return std::make_unique<StepPlan>(*cache_->PrepareStep(
        {{id, 0, Rows(pin_q_, kHeadsQ, kDim, kDtype), KvOf(pin_k_), KvOf(pin_v_), -1}}));
  }
  Bits pin_q_, pin_k_, pin_v_;  // what PinWithAStep's plan reads

  // One step on `layer`: appends `rows` new random rows (mirrored in *dense) and attends `rows`
  // causal query rows; checks O/LSE against the fp64 reference over *dense.
  void StepAndCheck(const std::string& id, int layer, int rows, DenseLayer* dense,
                    const std::string& where) {
    const Bits q = RandomRows(&rng_, rows, kHeadsQ, kDim, kDtype);
    const Bits k = KvRows(rows), v = KvRows(rows);
    absl::StatusOr<StepPlan> plan =
        cache_->PrepareStep({{id, layer, Rows(q, kHeadsQ, kDim, kDtype), KvOf(k), KvOf(v), -1}});
    ASSERT_TRUE(plan.ok()) << where << ": " << plan.status();
    dense->Append(k, v);
    Bits out(q.size(), 0x7e00);  // poisoned: NaN
    std::vector<float> lse(size_t(kHeadsQ * rows), NAN);
    plan->batch.causal = true;
    plan->batch.softmax_scale = kScale;
    plan->batch.items[0].out = out.data();
    plan->batch.items[0].lse = lse.data();
    AttendInfo info;
    ASSERT_TRUE(store_->Attend(plan->batch, &info).ok()) << where;
    EXPECT_EQ(
        testing::CheckAgainstReference(shape_, *dense, q, rows, true, kScale, out, lse, where), 0);
  }

  // The first `rows` tokens of a dense layer (what a truncated layer must attend over).
  static DenseLayer FirstRows(const DenseLayer& dense, int rows) {
    const size_t n = size_t(rows) * kHeadsKv * kDim;
    DenseLayer kept;
    kept.k.assign(dense.k.begin(), dense.k.begin() + long(n));
    kept.v.assign(dense.v.begin(), dense.v.begin() + long(n));
    return kept;
  }

  std::mt19937 rng_{20261130};
  SequenceShape shape_;
  std::vector<Bits> keep_;  // the prefix rows' bytes, alive while the test runs
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<CpuKvStore> store_;
  std::unique_ptr<SequenceCache> cache_;
};

// Verify 4 drafts, accept 2: the next step sees the prefix, the 2 kept drafts and its own token.
TEST_F(TruncateTest, LaterStepsAttendOverTheKeptRowsOnly) {
  std::vector<DenseLayer> dense;
  const std::string id = Create(7, &dense);
  StepAndCheck(id, 0, 4, &dense[0], "verification step");  // 11 tokens: 3 pages of 5
  EXPECT_EQ(cache_->Stats().pages_used, 3 + 2);
  absl::StatusOr<TruncateResult> cut = Cut(id, 9, {0});
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->lengths, (std::vector<int64_t>{9, 7}));
  EXPECT_EQ(cut->dropped, 2);
  EXPECT_EQ(cache_->Stats().pages_used, 2 + 2) << "the page wholly past token 9 goes back";
  dense[0] = FirstRows(dense[0], 9);
  StepAndCheck(id, 0, 1, &dense[0], "step after the cut");
  StepAndCheck(id, 0, 3, &dense[0], "next verification");
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{13, 7}));
}

// Freed pages go to the next sequence that grows; the cut layer's partial last page is kept, so
// that sequence's rows never land on the kept tokens.
TEST_F(TruncateTest, PagesPastTheCutServeOtherSequencesWithoutTouchingKeptRows) {
  std::vector<DenseLayer> dense_a, dense_b;
  const std::string a = Create(11, &dense_a);    // 3 pages per layer
  ASSERT_TRUE(Cut(a, 6, {}).ok());               // both layers: 2 pages each, the 2nd partial
  EXPECT_EQ(Lengths(a), (std::vector<int64_t>{6, 6}));
  EXPECT_EQ(cache_->Stats().pages_used, 4);
  const std::string b = Create(10, &dense_b);  // takes freed pages
  for (int layer = 0; layer < 2; ++layer) {
    dense_a[size_t(layer)] = FirstRows(dense_a[size_t(layer)], 6);
    StepAndCheck(a, layer, 2, &dense_a[size_t(layer)], "a after b took the pages");
    StepAndCheck(b, layer, 1, &dense_b[size_t(layer)], "b");
  }
  // To zero: every page back; the layer then starts over.
  absl::StatusOr<TruncateResult> cut = Cut(a, 0, {});
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->dropped, 16);
  EXPECT_EQ(cache_->Info(a)->bytes, 0);
  DenseLayer fresh;
  StepAndCheck(a, 1, 2, &fresh, "a from empty");
}

TEST_F(TruncateTest, RetriesChangeNothingAndBadCallsCutNothing) {
  std::vector<DenseLayer> dense;
  const std::string id = Create(8, &dense);
  ASSERT_TRUE(Cut(id, 5, {1}).ok());
  absl::StatusOr<TruncateResult> again = Cut(id, 5, {1});  // the answer was lost
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->dropped, 0);
  EXPECT_EQ(again->lengths, (std::vector<int64_t>{8, 5}));
  // Layer 0 could be cut to 6, layer 1 holds 5: ABORTED, and layer 0 keeps its 8.
  absl::StatusOr<TruncateResult> longer = Cut(id, 6, {0, 1});
  ASSERT_EQ(longer.status().code(), absl::StatusCode::kAborted) << longer.status();
  EXPECT_NE(longer.status().message().find("layer 1 holds 5 tokens, fewer than the 6"),
            std::string::npos)
      << longer.status();
  EXPECT_EQ(Cut(id, -1, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut(id, 1, {2}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut(id, 1, {0, 0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut("0123456789abcdef0123456789abcdef", 1, {}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{8, 5}));
  dense[0] = FirstRows(dense[0], 8);
  StepAndCheck(id, 0, 1, &dense[0], "after the refused calls");
}

// One call for a batch's speculative step: every sequence cut, or (one refused) none.
TEST_F(TruncateTest, ABatchIsCutWholeOrNotAtAll) {
  std::vector<DenseLayer> dense_a, dense_b;
  const std::string a = Create(12, &dense_a), b = Create(20, &dense_b);
  absl::StatusOr<std::vector<TruncateResult>> cut = cache_->Truncate({{a, 10, {}}, {b, 17, {1}}});
  ASSERT_TRUE(cut.ok()) << cut.status();
  ASSERT_EQ(cut->size(), 2u);
  EXPECT_EQ((*cut)[0].lengths, (std::vector<int64_t>{10, 10}));
  EXPECT_EQ((*cut)[0].dropped, 4);
  EXPECT_EQ((*cut)[1].lengths, (std::vector<int64_t>{20, 17}));
  EXPECT_EQ((*cut)[1].dropped, 3);
  const std::string gone = "0123456789abcdef0123456789abcdef";
  const std::vector<std::vector<TruncateItem>> refused = {
      {{a, 5, {}}, {gone, 1, {}}},  // NOT_FOUND
      {{a, 5, {}}, {b, 18, {}}},    // ABORTED: b's layer 1 holds 17
      {{a, 5, {}}, {a, 4, {0}}},    // INVALID_ARGUMENT: a twice
      {{a, 5, {}}, {b, 1, {5}}},    // INVALID_ARGUMENT: no layer 5
  };
  const absl::StatusCode codes[] = {absl::StatusCode::kNotFound, absl::StatusCode::kAborted,
                                    absl::StatusCode::kInvalidArgument,
                                    absl::StatusCode::kInvalidArgument};
  for (size_t i = 0; i < refused.size(); ++i) {
    absl::StatusOr<std::vector<TruncateResult>> r = cache_->Truncate(refused[i]);
    EXPECT_EQ(r.status().code(), codes[i]) << i << ": " << r.status();
    EXPECT_NE(r.status().message().find(i == 0 ? "unknown" : "item 1"), std::string::npos)
        << r.status();
    EXPECT_EQ(Lengths(a), (std::vector<int64_t>{10, 10})) << i << ": a was cut";
  }
  dense_b[1] = FirstRows(dense_b[1], 17);
  StepAndCheck(b, 1, 2, &dense_b[1], "b after the refused calls");
}

// A prepared step reads the rows past the cut: Truncate waits for it (or its own deadline).
// What a Truncate asks is checked before it waits for the steps on its sequences: a malformed call
// waited for them (then DEADLINE_EXCEEDED, or as long as the step ran) instead of its
// INVALID_ARGUMENT.
TEST_F(TruncateTest, AMalformedCallIsRefusedAtOnceWhileAStepRuns) {
  std::vector<DenseLayer> dense;
  const std::string id = Create(4, &dense);
  const Bits q = RandomRows(&rng_, 1, kHeadsQ, kDim, kDtype);
  const Bits k = KvRows(1), v = KvRows(1);
  absl::StatusOr<StepPlan> plan =
      cache_->PrepareStep({{id, 0, Rows(q, kHeadsQ, kDim, kDtype), KvOf(k), KvOf(v), -1}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const absl::Time start = absl::Now();
  EXPECT_EQ(Cut(id, -5, {0}, deadline).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut(id, 2, {7}, deadline).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut(id, 2, {1, 1}, deadline).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Truncate({{id, 2, {0}}, {id, 2, {1}}}, deadline).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Cut("no-such-sequence", 2, {0}, deadline).status().code(), absl::StatusCode::kNotFound);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "a malformed Truncate waited for the step";
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{5, 4}));
}

TEST_F(TruncateTest, WaitsForThePreparedStepThatReadsTheRows) {
  std::vector<DenseLayer> dense;
  const std::string id = Create(4, &dense);
  std::unique_ptr<StepPlan> plan = PinWithAStep(id);
  absl::StatusOr<TruncateResult> early = Cut(id, 4, {0}, absl::Now() + absl::Milliseconds(60));
  ASSERT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{6, 4}));
  std::future<absl::StatusOr<TruncateResult>> waiting = std::async(
      std::launch::async, [&] { return Cut(id, 4, {0}, absl::Now() + absl::Seconds(30)); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  plan.reset();  // the step ends
  absl::StatusOr<TruncateResult> cut = waiting.get();
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->dropped, 2);
}

// Under a NoWaitScope (the gRPC edge's first try of a control call) a Truncate that would wait for
// a step gives up at once with nothing cut and says so; without one it waits as before; and the
// scope ends with its block (it must not reach the thread's next call).
TEST_F(TruncateTest, UnderANoWaitScopeATruncateThatWouldWaitGivesUpAtOnceCuttingNothing) {
  std::vector<DenseLayer> dense;
  const std::string id = Create(4, &dense);
  std::unique_ptr<StepPlan> plan = PinWithAStep(id);
  const absl::Time start = absl::Now();
  {
    NoWaitScope no_wait;
    EXPECT_FALSE(no_wait.would_have_waited());
    const absl::StatusOr<TruncateResult> tried = Cut(id, 4, {0}, absl::Now() + absl::Seconds(30));
    EXPECT_EQ(tried.status().code(), absl::StatusCode::kDeadlineExceeded) << tried.status();
    EXPECT_TRUE(no_wait.would_have_waited());
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "the try waited for the step";
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{6, 4}));
  {
    std::vector<DenseLayer> other_dense;
    const std::string other = Create(4, &other_dense);
    NoWaitScope no_wait;  // a call that need not wait runs whole
    EXPECT_TRUE(Cut(other, 2, {0}, absl::Now() + absl::Seconds(30)).ok());
    EXPECT_FALSE(no_wait.would_have_waited());
    EXPECT_EQ(Lengths(other), (std::vector<int64_t>{2, 4}));
  }
  std::future<absl::StatusOr<TruncateResult>> waiting = std::async(
      std::launch::async, [&] { return Cut(id, 4, {0}, absl::Now() + absl::Seconds(30)); });
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  const absl::StatusOr<TruncateResult> same_thread = [&] {
    { NoWaitScope ended; }
    return Cut(id, 4, {0}, absl::Now() + absl::Milliseconds(150));  // waits: the scope is over
  }();
  EXPECT_EQ(same_thread.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  plan.reset();
  ASSERT_TRUE(waiting.get().ok());
  EXPECT_EQ(Lengths(id), (std::vector<int64_t>{4, 4}));
}

}  // namespace
}  // namespace flashserve::kvcache
