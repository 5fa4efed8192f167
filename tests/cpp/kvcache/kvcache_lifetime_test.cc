// Lifetimes and all-or-nothing failures of the KV cache: a step whose rows fail to land half-way
// changes no sequence.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"
#include "runtime/cpu_backend.h"
#include "runtime/sequence_runtime.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::RandomRows;
using testing::Rows;

// A store that refuses the writes whose source is `refused` (as a device fault would) and keeps
// no bytes: enough for the cache's bookkeeping.
class RefusingStore final : public KvStore {
 public:
  std::string_view kind() const override { return "refusing"; }
  int64_t capacity_bytes() const override { return 4 << 20; }
  absl::Status Write(int64_t, const void* src, int64_t, BytesAt) override {
    if (src == refused) return absl::InternalError("refused write (device fault)");
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo*) override { return absl::OkStatus(); }
  const void* refused = nullptr;
};

// A step is all or nothing: when the second item's rows fail to land, the first item's rows,
// already written, must not count either (its length moved and stayed moved: a client retrying
// without expected_length appended them twice).
TEST(SequenceCacheStepFailure, AStepWhoseRowsFailHalfWayChangesNoLength) {
  RefusingStore store;
  KvCacheOptions options;
  options.capacity_bytes = 4 << 20;
  options.page_tokens = 64;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, &store, nullptr);
  const DType f16 = DType::kFloat16;
  CreateRequest create;
  create.shape = {1, 1, 1, 64, f16};
  const std::string a = cache->CreateSequence(create)->id;
  const std::string b = cache->CreateSequence(create)->id;
  std::mt19937 rng(13);
  const Bits q = RandomRows(&rng, 1, 1, 64, f16);
  const Bits good = RandomRows(&rng, 1, 1, 64, f16);
  const Bits bad = RandomRows(&rng, 1, 1, 64, f16);
  store.refused = bad.data();
  const HostRows qr = Rows(q, 1, 64, f16), gr = Rows(good, 1, 64, f16), br = Rows(bad, 1, 64, f16);
  absl::StatusOr<StepPlan> plan = cache->PrepareStep({{a, 0, qr, gr, gr}, {b, 0, qr, br, br}});
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kInternal) << plan.status();
  EXPECT_EQ(cache->Info(a)->lengths[0], 0) << "a failed step appended the rows of its first item";
  EXPECT_EQ(cache->Info(b)->lengths[0], 0);
  // The same step once the fault is gone appends each row once, and the pool empties.
  store.refused = nullptr;
  plan = cache->PrepareStep({{a, 0, qr, gr, gr}, {b, 0, qr, br, br}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->batch.items[0].length, 1);
  EXPECT_EQ(plan->batch.items[1].length, 1);
  *plan = StepPlan();
  EXPECT_TRUE(cache->Release({a, b}).empty());
  EXPECT_EQ(cache->Stats().pages_used, 0);
}

}  // namespace
}  // namespace flashserve::kvcache
