// The order of a store's writes as the SequenceCache asks for it (a recording fake store): freed
// pages fenced before their next owner writes, sources awaited once per append, a step that fails
// half-way settling what it wrote, a cut inside a page fenced before the next rows there.
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"

namespace flashserve::kvcache {
namespace {

// A store that only records what it is asked, in order.
class RecordingStore final : public KvStore {
 public:
  std::string_view kind() const override { return "recording"; }
  int64_t capacity_bytes() const override { return 4 << 20; }
  absl::Status Write(int64_t offset, const void*, int64_t, kvcache::BytesAt) override {
    if (fail_writes_from >= 0 && writes++ >= fail_writes_from) {
      events.push_back("X");
      return absl::InternalError("refused copy");
    }
    events.push_back(absl::StrCat("W", offset));
    return absl::OkStatus();
  }
  void Fence() override { events.push_back("F"); }
  absl::Status Settle() override {
    events.push_back("S");
    return absl::OkStatus();
  }
  absl::Status AwaitSources() override {
    if (record_awaits) events.push_back("A");
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo*) override { return absl::OkStatus(); }
  std::vector<std::string> events;
  bool record_awaits = false;
  int fail_writes_from = -1;  // the writes from this one on fail (counted from 0; -1: none)
  int writes = 0;
};

TEST(SequenceCacheFence, FreedPagesAreFencedBeforeTheirNextOwnerWrites) {
  RecordingStore store;
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 16);
  std::mt19937 rng(3);
  testing::Bits k = testing::RandomRows(&rng, 1, 1, 64, kernels::DType::kFloat16);
  CreateRequest request;
  request.shape = {1, 1, 1, 64, kernels::DType::kFloat16};
  request.prefix.push_back({0, testing::Rows(k, 1, 64, kernels::DType::kFloat16),
                            testing::Rows(k, 1, 64, kernels::DType::kFloat16)});
  const std::string a = cache->CreateSequence(request)->id;
  EXPECT_TRUE(cache->Release({a}).empty());
  ASSERT_TRUE(cache->CreateSequence(request).ok());
  // A's K and V rows, the fence of its release, then B's rows on the same page.
  ASSERT_EQ(store.events.size(), 5u);
  EXPECT_EQ(store.events[2], "F");
  EXPECT_EQ(store.events[0], store.events[3])
      << "B did not reuse A's page: the test proves nothing";
}

// The rows' sources are the caller's (a request freed when the call returns): an append waits
// once, after all its writes, until the store has read them -- not once per page.
TEST(SequenceCacheFence, AppendAwaitsItsSourcesOnceAfterItsWrites) {
  RecordingStore store;
  store.record_awaits = true;
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 16);
  std::mt19937 rng(6);
  const kernels::DType f16 = kernels::DType::kFloat16;
  CreateRequest request;
  request.shape = {1, 1, 1, 64, f16};
  const std::string id = cache->CreateSequence(request)->id;
  testing::Bits forty = testing::RandomRows(&rng, 40, 1, 64, f16);  // three pages
  store.events.clear();
  ASSERT_TRUE(
      cache->Append(id, {{0, testing::Rows(forty, 1, 64, f16), testing::Rows(forty, 1, 64, f16)}})
          .ok());
  ASSERT_EQ(store.events.size(), 7u) << absl::StrJoin(store.events, " ");  // 3 x (K, V), then A
  EXPECT_EQ(std::count(store.events.begin(), store.events.end(), "A"), 1);
  EXPECT_EQ(store.events.back(), "A");
}

// A step whose second sequence's rows fail to copy has written the first one's, which may come
// from the client's region: the store settles them before the call (and its lease) ends, and no
// length moves.
TEST(SequenceCacheFence, AStepThatFailsHalfWaySettlesTheRowsItWrote) {
  RecordingStore store;
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 16);
  std::mt19937 rng(7);
  const kernels::DType f16 = kernels::DType::kFloat16;
  CreateRequest request;
  request.shape = {1, 1, 1, 64, f16};
  const std::string a = cache->CreateSequence(request)->id;
  const std::string b = cache->CreateSequence(request)->id;
  testing::Bits one = testing::RandomRows(&rng, 1, 1, 64, f16);
  auto item = [&](const std::string& id) {
    return StepItem{id, 0, testing::Rows(one, 1, 64, f16), testing::Rows(one, 1, 64, f16),
                    testing::Rows(one, 1, 64, f16)};
  };
  store.events.clear();
  store.fail_writes_from = 2;  // a's K and V go through, b's K fails
  absl::StatusOr<StepPlan> plan = cache->PrepareStep({item(a), item(b)});
  ASSERT_FALSE(plan.ok());
  ASSERT_EQ(store.events.size(), 4u) << absl::StrJoin(store.events, " ");
  EXPECT_EQ(store.events[2], "X");
  EXPECT_EQ(store.events[3], "S") << "the failed step returned with a's rows unsettled";
  EXPECT_EQ(cache->Info(a)->lengths[0], 0);
  EXPECT_EQ(cache->Info(b)->lengths[0], 0);
  store.fail_writes_from = -1;  // a retry appends both
  plan = cache->PrepareStep({item(a), item(b)});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->batch.items[0].length, 1);
  EXPECT_EQ(plan->batch.items[1].length, 1);
}

// A cut inside the last page frees nothing, yet the rows written next at the places it gave up
// share them with the dropped rows' writes, which a store may still defer: a fence between.
TEST(SequenceCacheFence, TruncateInsideAPageIsFencedBeforeTheNextRowsThere) {
  RecordingStore store;
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 16);
  std::mt19937 rng(4);
  const kernels::DType f16 = kernels::DType::kFloat16;
  testing::Bits ten = testing::RandomRows(&rng, 10, 1, 64, f16);
  testing::Bits three = testing::RandomRows(&rng, 3, 1, 64, f16);
  CreateRequest request;
  request.shape = {1, 1, 1, 64, f16};
  request.prefix.push_back({0, testing::Rows(ten, 1, 64, f16), testing::Rows(ten, 1, 64, f16)});
  const std::string id = cache->CreateSequence(request)->id;
  ASSERT_TRUE(cache->Truncate({{id, 4, {}}}).ok());
  ASSERT_TRUE(
      cache->Append(id, {{0, testing::Rows(three, 1, 64, f16), testing::Rows(three, 1, 64, f16)}})
          .ok());
  // The prefix's K and V, the fence of the cut, then the new rows from row 4 of the same page.
  ASSERT_EQ(store.events.size(), 5u) << absl::StrJoin(store.events, " ");
  EXPECT_EQ(store.events[2], "F");
  EXPECT_EQ(store.events[3], absl::StrCat("W", 4 * 128))
      << "the new rows did not go where the cut rows were: the test proves nothing";
}

// An append that failed on the device leaves the pages it took (no length counts them), with the
// rows it wrote before the fault. A Truncate that frees them drops no token, yet must fence them
// before their next owner writes there (it fenced only when it dropped tokens).
TEST(SequenceCacheFence, SurplusPagesOfAFailedAppendAreFencedWhenATruncateFreesThem) {
  RecordingStore store;
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 16);
  std::mt19937 rng(8);
  const kernels::DType f16 = kernels::DType::kFloat16;
  testing::Bits forty = testing::RandomRows(&rng, 40, 1, 64, f16);  // three pages
  testing::Bits one = testing::RandomRows(&rng, 1, 1, 64, f16);
  CreateRequest request;
  request.shape = {1, 1, 1, 64, f16};
  const std::string a = cache->CreateSequence(request)->id;
  store.fail_writes_from = 2;  // the first page's K and V land, then the device faults
  EXPECT_FALSE(
      cache->Append(a, {{0, testing::Rows(forty, 1, 64, f16), testing::Rows(forty, 1, 64, f16)}})
          .ok());
  store.fail_writes_from = -1;
  const absl::StatusOr<std::vector<TruncateResult>> cut = cache->Truncate({{a, 0, {}}});
  ASSERT_TRUE(cut.ok()) << cut.status();
  EXPECT_EQ(cut->front().dropped, 0);
  EXPECT_EQ(cache->Stats().used_bytes, 0) << "the failed append's pages were not freed";
  request.prefix.push_back({0, testing::Rows(one, 1, 64, f16), testing::Rows(one, 1, 64, f16)});
  ASSERT_TRUE(cache->CreateSequence(request).ok());
  // The failed append's K and V, its fault, the fence of the cut, then B's rows on the same page.
  ASSERT_EQ(store.events.size(), 6u) << absl::StrJoin(store.events, " ");
  EXPECT_EQ(store.events[3], "F") << absl::StrJoin(store.events, " ");
  EXPECT_EQ(store.events[0], store.events[4])
      << "B did not reuse the failed append's page: the test proves nothing";
}

}  // namespace
}  // namespace flashserve::kvcache
