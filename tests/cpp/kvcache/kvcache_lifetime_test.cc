// Lifetimes and all-or-nothing failures of the KV cache and the decode runtime: a step whose rows
// fail to land half-way changes no sequence, and a SequenceRuntime is not destroyed under a decode
// call it accepted.
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
  explicit RefusingStore(int64_t capacity = 4 << 20) : capacity_(capacity) {}
  std::string_view kind() const override { return "refusing"; }
  int64_t capacity_bytes() const override { return capacity_; }
  absl::Status Write(int64_t, const void* src, int64_t, BytesAt) override {
    if (src == refused) return absl::InternalError("refused write (device fault)");
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo*) override { return absl::OkStatus(); }
  const void* refused = nullptr;

 private:
  const int64_t capacity_;
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

// Page numbers are 32-bit in the page tables: a shape whose pages a pool could hold more than
// 2^31 - 1 of is refused when it is created, not numbered wrongly once the pool fills.
TEST(SequenceCacheCreate, AShapeWhosePagesThePoolCouldNotNumberIsRefused) {
  const int64_t pool = int64_t(1) << 40;  // 1 TiB (only the bookkeeping exists: 512 Ki slabs)
  RefusingStore store(pool);
  KvCacheOptions options;
  options.capacity_bytes = pool;
  options.page_tokens = 1;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, &store, nullptr);
  CreateRequest tiny;  // a page of 1 token, 1 KV head of 8: 32 bytes, rounded up to 256
  tiny.shape = {1, 1, 1, 8, DType::kFloat16};
  const absl::StatusOr<SequenceStatus> refused = cache->CreateSequence(tiny);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("2^31 - 1"), std::string::npos) << refused.status();
  CreateRequest wide = tiny;  // 32 heads: pages of 1 KiB, 2^30 of them in the pool
  wide.shape.heads_kv = wide.shape.heads_q = 32;
  EXPECT_TRUE(cache->CreateSequence(wide).ok());
}

}  // namespace
}  // namespace flashserve::kvcache

namespace flashserve {
namespace {

using kernels::DType;
using kvcache::testing::Bits;
using kvcache::testing::Gate;
using kvcache::testing::RandomRows;
using kvcache::testing::Rows;

// A decode call the scheduler accepted but has not run yet refers to the runtime (its cache, its
// store): the runtime must not go away before it ran. It did: the server destroys the runtime
// before the scheduler, whose destructor then ran the queued call on the freed runtime (heap
// use-after-free, e.g. after a grace period that ended with decode calls still queued).
TEST(SequenceRuntimeLifetime, DestroyingTheRuntimeWaitsForTheDecodeCallsItQueued) {
  CpuBackendOptions cpu;
  cpu.num_threads = 1;
  std::unique_ptr<CpuBackend> backend = *CpuBackend::Create(cpu);
  SchedulerOptions scheduler_options;
  scheduler_options.num_workers = 1;
  std::unique_ptr<Scheduler> scheduler = *Scheduler::Create(scheduler_options);
  SequenceRuntimeOptions options;
  options.cache.capacity_bytes = 4 << 20;
  options.cache.page_tokens = 16;
  options.launches_in_flight = 1;
  std::unique_ptr<SequenceRuntime> runtime =
      *SequenceRuntime::Create(options, backend.get(), scheduler.get(), nullptr);
  const DType f16 = DType::kFloat16;
  kvcache::CreateRequest create;
  create.shape = {1, 1, 1, 32, f16};
  const std::string id = runtime->cache().CreateSequence(create)->id;

  Gate gate;  // holds the only worker, so the decode call below waits in the queue
  ASSERT_TRUE(scheduler->Submit([&gate] { gate.Wait(); }).ok());
  std::mt19937 rng(17);
  const Bits q = RandomRows(&rng, 1, 1, 32, f16), k = RandomRows(&rng, 1, 1, 32, f16);
  Bits out(q.size(), 0x7e00);
  std::promise<absl::Status> answered;
  auto call = std::make_shared<DecodeCall>();
  call->items.push_back({id, 0, Rows(q, 1, 32, f16), Rows(k, 1, 32, f16), Rows(k, 1, 32, f16)});
  call->softmax_scale = 0.125f;
  call->out.push_back(out.data());
  call->received = absl::Now();
  call->done = [&answered](const absl::Status& s, const DecodeReport&) { answered.set_value(s); };
  runtime->Submit(call);
  call.reset();

  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    runtime.reset();
    destroyed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(destroyed.load()) << "the runtime was destroyed with a decode call still queued";
  gate.Open();
  destroyer.join();
  std::future<absl::Status> answer = answered.get_future();
  ASSERT_EQ(answer.wait_for(std::chrono::seconds(0)), std::future_status::ready)
      << "the runtime's destructor returned before its queued call was answered";
  EXPECT_TRUE(answer.get().ok());
  scheduler.reset();
}

}  // namespace
}  // namespace flashserve
