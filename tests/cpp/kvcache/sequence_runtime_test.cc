// SequenceRuntime on the CPU backend: calls within --batch_window_us, or (--batch_when_busy) that
// arrive while a launch runs, share one launch (and stay correct), calls of another shape get their own, cancelled / expired / queue-full calls change
// nothing, and a call with too many items is refused before anything runs; accepted calls count
// their shared-memory input paths in request_inputs_total; a DecodeBatcher may be destroyed right
// after its last batch is done.
#include "runtime/sequence_runtime.h"

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kv_test_util.h"
#include "metrics/server_metrics.h"
#include "runtime/cpu_backend.h"
#include "runtime/decode_batcher.h"

namespace flashserve {
namespace {

using kernels::DType;
using kvcache::testing::Bits;
using kvcache::testing::DenseLayer;
using kvcache::testing::RandomRows;
using kvcache::testing::Rows;

struct Answer {
  absl::Status status;
  DecodeReport report;
};

class SequenceRuntimeTest : public ::testing::Test {
 protected:
  // `in_flight`: --decode_launches_in_flight; `workers`: the scheduler's (0: as many).
  void Make(int64_t window_us, int queue_capacity = 64, bool when_busy = false,
            ServerMetrics* metrics = nullptr, int in_flight = 1, int workers = 0) {
    CpuBackendOptions cpu;
    cpu.num_threads = 2;
    backend_ = *CpuBackend::Create(cpu);
    SchedulerOptions scheduler;
    scheduler.queue_capacity = queue_capacity;
    scheduler.num_workers = workers > 0 ? workers : in_flight;
    scheduler_ = *Scheduler::Create(scheduler);
    SequenceRuntimeOptions options;
    options.cache.capacity_bytes = 8 << 20;
    options.cache.page_tokens = 16;
    options.batch_window_us = window_us;
    options.batch_when_busy = when_busy;
    options.max_batch_sequences = 8;
    options.launches_in_flight = in_flight;
    runtime_ = *SequenceRuntime::Create(options, backend_.get(), scheduler_.get(), metrics);
  }

  std::string Create(const kvcache::SequenceShape& s, DenseLayer* dense, int rows) {
    Bits k = RandomRows(&rng_, rows, s.heads_kv, s.head_dim, s.dtype);
    Bits v = RandomRows(&rng_, rows, s.heads_kv, s.head_dim, s.dtype);
    dense->Append(k, v);
    kvcache::CreateRequest request;
    request.shape = s;
    request.prefix.push_back(
        {0, Rows(k, s.heads_kv, s.head_dim, s.dtype), Rows(v, s.heads_kv, s.head_dim, s.dtype)});
    return runtime_->cache().CreateSequence(request)->id;
  }

  // A one-item call appending one row; its buffers live in the returned holder.
  struct Holder {
    Bits q, k, v, out;
    std::promise<Answer> answer;
  };
  std::shared_ptr<DecodeCall> Call(const kvcache::SequenceShape& s, const std::string& id,
                                   Holder* h) {
    h->q = RandomRows(&rng_, 1, s.heads_q, s.head_dim, s.dtype);
    h->k = RandomRows(&rng_, 1, s.heads_kv, s.head_dim, s.dtype);
    h->v = RandomRows(&rng_, 1, s.heads_kv, s.head_dim, s.dtype);
    h->out.assign(h->q.size(), 0x7e00);
    auto call = std::make_shared<DecodeCall>();
    call->items.push_back({id, 0, Rows(h->q, s.heads_q, s.head_dim, s.dtype),
                           Rows(h->k, s.heads_kv, s.head_dim, s.dtype),
                           Rows(h->v, s.heads_kv, s.head_dim, s.dtype)});
    call->softmax_scale = 1.f / std::sqrt(float(s.head_dim));
    call->out.push_back(h->out.data());
    call->received = absl::Now();
    call->done = [h](const absl::Status& status, const DecodeReport& report) {
      h->answer.set_value({status, report});
    };
    return call;
  }

  void HoldThenSpaceOut(int held, const std::vector<int>& batched);

  std::mt19937 rng_{7};
  std::unique_ptr<ServerMetrics> metrics_;  // first: the runtime below records into it till its end
  std::unique_ptr<CpuBackend> backend_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<SequenceRuntime> runtime_;
};

TEST_F(SequenceRuntimeTest, CallsWithinTheWindowShareOneLaunchAndAreCorrect) {
  Make(300000);  // 300 ms: the calls below, built first, are submitted well within it
  const kvcache::SequenceShape s{1, 4, 2, 32, DType::kFloat16};
  const kvcache::SequenceShape other{1, 2, 2, 32, DType::kFloat16};
  std::vector<DenseLayer> dense(5);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(Create(s, &dense[size_t(i)], 5 + 9 * i));
  ids.push_back(Create(other, &dense[4], 3));
  std::vector<Holder> holders(5);
  std::vector<std::shared_ptr<DecodeCall>> calls;
  for (size_t i = 0; i < 5; ++i) calls.push_back(Call(i < 4 ? s : other, ids[i], &holders[i]));
  for (auto& call : calls) runtime_->Submit(std::move(call));
  for (size_t i = 0; i < 5; ++i) {
    const Answer answer = holders[i].answer.get_future().get();
    ASSERT_TRUE(answer.status.ok()) << answer.status;
    EXPECT_EQ(answer.report.batched_calls, i < 4 ? 4 : 1) << "call " << i;
    dense[i].Append(holders[i].k, holders[i].v);
    kvcache::testing::CheckAgainstReference(i < 4 ? s : other, dense[i], holders[i].q, 1, false,
                                            1.f / std::sqrt(32.f), holders[i].out, {},
                                            absl::StrCat("call ", i));
  }
}

TEST_F(SequenceRuntimeTest, WithoutAWindowEachCallRunsAlone) {
  Make(0);
  const kvcache::SequenceShape s{1, 4, 2, 32, DType::kBFloat16};
  std::vector<DenseLayer> dense(3);
  std::vector<Holder> holders(3);
  for (size_t i = 0; i < 3; ++i) runtime_->Submit(Call(s, Create(s, &dense[i], 4), &holders[i]));
  for (Holder& h : holders) EXPECT_EQ(h.answer.get_future().get().report.batched_calls, 1);
}

// Holds `call`'s answer (and so its batch) until `released`.
void HoldAnswer(DecodeCall* call, std::shared_future<void> released) {
  auto done = call->done;
  call->done = [done, released](const absl::Status& st, const DecodeReport& r) {
    released.wait();
    done(st, r);
  };
}

// Four one-row calls with when_busy: the first `held` run at once and hold their batches open
// until released; the others arrive spaced out (a batcher that did not wait for a running batch
// would hand each on alone), then everything is released. Checks each call's batched_calls and
// its answer against the fp64 reference.
void SequenceRuntimeTest::HoldThenSpaceOut(int held, const std::vector<int>& batched) {
  const kvcache::SequenceShape s{1, 4, 2, 32, DType::kFloat16};
  std::vector<DenseLayer> dense(4);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(Create(s, &dense[size_t(i)], 3 + 7 * i));
  std::vector<Holder> holders(4);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  for (size_t i = 0; i < 4; ++i) {
    auto call = Call(s, ids[i], &holders[i]);
    if (int(i) < held) HoldAnswer(call.get(), released);
    runtime_->Submit(call);
    if (int(i) >= held) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  release.set_value();
  for (size_t i = 0; i < 4; ++i) {
    const Answer answer = holders[i].answer.get_future().get();
    ASSERT_TRUE(answer.status.ok()) << answer.status;
    EXPECT_EQ(answer.report.batched_calls, batched[i]) << "call " << i;
    dense[i].Append(holders[i].k, holders[i].v);
    kvcache::testing::CheckAgainstReference(s, dense[i], holders[i].q, 1, false,
                                            1.f / std::sqrt(32.f), holders[i].out, {},
                                            absl::StrCat("call ", i));
  }
}

TEST_F(SequenceRuntimeTest, WhenBusyCallsArrivingDuringALaunchShareTheNextOne) {
  Make(0, 64, /*when_busy=*/true);  // one launch in flight
  HoldThenSpaceOut(1, {1, 3, 3, 3});
}

TEST_F(SequenceRuntimeTest, WhenBusyWithTwoInFlightTheThirdCallWaitsForARunningOne) {
  Make(0, 64, /*when_busy=*/true, nullptr, /*in_flight=*/2);
  HoldThenSpaceOut(2, {1, 1, 2, 2});
}

TEST_F(SequenceRuntimeTest, WhenBusyRunsNoMoreBatchesThanTheSchedulerHasWorkers) {
  // Two in flight but one worker: a second batch would only wait in the scheduler's queue.
  Make(0, 64, /*when_busy=*/true, nullptr, /*in_flight=*/2, /*workers=*/1);
  HoldThenSpaceOut(1, {1, 3, 3, 3});
}

// Calls waiting for a running batch that expire or are cancelled meanwhile are answered then, not
// when the batch ends: they held their place in the bounded queue (and their in-flight bytes).
TEST_F(SequenceRuntimeTest, WhenBusyCallsThatGoStaleWhileWaitingAreAnsweredThen) {
  Make(0, 64, /*when_busy=*/true);  // one launch in flight
  const kvcache::SequenceShape s{1, 2, 1, 32, DType::kFloat16};
  std::vector<DenseLayer> dense(4);
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(Create(s, &dense[size_t(i)], 5));
  std::vector<Holder> holders(4);
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  auto held = Call(s, ids[0], &holders[0]);
  HoldAnswer(held.get(), released);
  runtime_->Submit(held);
  auto expiring = Call(s, ids[1], &holders[1]);
  expiring->deadline = absl::Now() + absl::Milliseconds(50);
  auto cancelled = Call(s, ids[2], &holders[2]);
  auto cancel = std::make_shared<std::atomic<bool>>(false);
  cancelled->cancelled = [cancel] { return cancel->load(); };
  auto live = Call(s, ids[3], &holders[3]);
  for (const auto& call : {expiring, cancelled, live}) runtime_->Submit(call);
  cancel->store(true);
  std::future<Answer> expired = holders[1].answer.get_future();
  std::future<Answer> gone = holders[2].answer.get_future();
  const bool expired_early = expired.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  const bool gone_early = gone.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
  release.set_value();
  EXPECT_TRUE(expired_early) << "an expired call waited for the running batch";
  EXPECT_TRUE(gone_early) << "a cancelled call waited for the running batch";
  EXPECT_EQ(expired.get().status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(gone.get().status.code(), absl::StatusCode::kCancelled);
  for (size_t i : {size_t(0), size_t(3)}) {
    const Answer answer = holders[i].answer.get_future().get();
    ASSERT_TRUE(answer.status.ok()) << answer.status;
    dense[i].Append(holders[i].k, holders[i].v);
    kvcache::testing::CheckAgainstReference(s, dense[i], holders[i].q, 1, false,
                                            1.f / std::sqrt(32.f), holders[i].out, {},
                                            absl::StrCat("call ", i));
  }
  EXPECT_EQ(runtime_->cache().Info(ids[1])->lengths[0], 5);
  EXPECT_EQ(runtime_->cache().Info(ids[2])->lengths[0], 5);
}

TEST_F(SequenceRuntimeTest, CancelledAndExpiredCallsAppendNothing) {
  Make(0);
  const kvcache::SequenceShape s{1, 2, 1, 32, DType::kFloat16};
  DenseLayer dense;
  const std::string id = Create(s, &dense, 6);
  Holder cancelled, expired;
  auto call = Call(s, id, &cancelled);
  call->cancelled = [] { return true; };
  runtime_->Submit(call);
  EXPECT_EQ(cancelled.answer.get_future().get().status.code(), absl::StatusCode::kCancelled);
  call = Call(s, id, &expired);
  call->deadline = absl::Now() - absl::Seconds(1);
  runtime_->Submit(call);
  EXPECT_EQ(expired.answer.get_future().get().status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(runtime_->cache().Info(id)->lengths[0], 6);
}

TEST_F(SequenceRuntimeTest, AFullQueueRefusesAtOnce) {
  Make(0, 1);
  const kvcache::SequenceShape s{1, 2, 1, 32, DType::kFloat16};
  DenseLayer dense;
  const std::string id = Create(s, &dense, 2);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false, started = false;
  ASSERT_TRUE(scheduler_
                  ->Submit([&] {  // occupies the one worker
                    std::unique_lock<std::mutex> lock(mu);
                    started = true;
                    cv.notify_all();
                    cv.wait(lock, [&] { return release; });
                  })
                  .ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return started; });
  }
  ASSERT_TRUE(scheduler_->Submit([] {}).ok());  // fills the queue of one
  Holder refused;
  runtime_->Submit(Call(s, id, &refused));
  EXPECT_EQ(refused.answer.get_future().get().status.code(), absl::StatusCode::kResourceExhausted);
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  scheduler_->WaitIdle(absl::Now() + absl::Seconds(10));
  EXPECT_EQ(runtime_->cache().Info(id)->lengths[0], 2);
}

TEST_F(SequenceRuntimeTest, TooManyItemsIsInvalidArgument) {
  Make(0);
  const kvcache::SequenceShape s{1, 2, 1, 32, DType::kFloat16};
  DenseLayer dense;
  Holder h;
  auto call = Call(s, Create(s, &dense, 2), &h);
  for (int i = 0; i < 8; ++i) call->items.push_back(call->items[0]);  // 9 > max 8
  runtime_->Submit(call);
  EXPECT_EQ(h.answer.get_future().get().status.code(), absl::StatusCode::kInvalidArgument);
}

TEST(SequenceRuntimeOptionsTest, ALaunchFitsTheDecodeKernelsGrid) {
  SequenceRuntimeOptions options;  // the cache's own options at their defaults
  options.max_batch_sequences = 65535;
  EXPECT_TRUE(options.Check().ok()) << options.Check();
  options.max_batch_sequences = 65536;  // the kernel's batch is gridDim.z
  EXPECT_EQ(options.Check().code(), absl::StatusCode::kInvalidArgument);
  options.max_batch_sequences = 0;
  EXPECT_EQ(options.Check().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(SequenceRuntimeTest, CallsThatRunCountTheirSharedMemoryInputPathsOnce) {
  metrics_ = std::make_unique<ServerMetrics>();
  Make(0, 64, false, metrics_.get());
  const kvcache::SequenceShape s{1, 2, 1, 32, DType::kFloat16};
  DenseLayer dense;
  const std::string id = Create(s, &dense, 2);
  Holder inline_rows, system, both, refused;
  runtime_->Submit(Call(s, id, &inline_rows));
  auto call = Call(s, id, &system);
  call->shm_system_inputs = true;  // as BuildDecodeStep sets them from the call's SequenceShm
  runtime_->Submit(call);
  call = Call(s, id, &both);
  call->shm_system_inputs = call->shm_cuda_inputs = true;
  runtime_->Submit(call);
  call = Call(s, id, &refused);
  call->shm_system_inputs = true;
  for (int i = 0; i < 8; ++i) call->items.push_back(call->items[0]);  // 9 > max 8: refused
  runtime_->Submit(call);
  Holder expired;
  call = Call(s, id, &expired);
  call->shm_system_inputs = true;
  call->deadline = absl::Now() - absl::Seconds(1);  // accepted, then dropped before it runs
  runtime_->Submit(call);
  for (Holder* h : {&inline_rows, &system, &both}) {
    EXPECT_TRUE(h->answer.get_future().get().status.ok());
  }
  EXPECT_EQ(refused.answer.get_future().get().status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(expired.answer.get_future().get().status.code(),
            absl::StatusCode::kDeadlineExceeded);
  const std::string text = metrics_->Render();
  for (const auto& [path, count] : {std::pair<const char*, int>{"shm_system", 2},
                                    {"shm_cuda", 1}, {"in_place", 0}, {"copied", 0}}) {
    const std::string line =
        absl::StrCat("flashserve_request_inputs_total{path=\"", path, "\"} ", count, "\n");
    EXPECT_NE(text.find(line), std::string::npos) << line;
  }
}

// The edge's own time (received -> Submit) is reported as prepare_us, not as queue time: a call
// received 10 s before it was submitted reports >= 10 s of preparing and a queue far shorter (two
// thread wake-ups; a loaded CI machine took 136 ms for them, so the split is read at seconds).
TEST_F(SequenceRuntimeTest, TheEdgesTimeIsPrepareNotQueue) {
  Make(0);
  const kvcache::SequenceShape s{1, 4, 2, 32, DType::kFloat16};
  DenseLayer dense;
  const std::string id = Create(s, &dense, 4);
  Holder h;
  auto call = Call(s, id, &h);
  call->received = absl::Now() - absl::Seconds(10);
  runtime_->Submit(call);
  const Answer answer = h.answer.get_future().get();
  ASSERT_TRUE(answer.status.ok()) << answer.status;
  EXPECT_GE(answer.report.prepare_us, 10'000'000);
  EXPECT_GE(answer.report.queue_us, 0);
  EXPECT_LT(answer.report.queue_us, 5'000'000);  // an idle scheduler starts it at once
}

// A batch answered from another thread just before the batcher is destroyed: Stop() returns once
// the batch is done, so BatchDone must not touch the batcher after making that visible (it once
// notified the condition variable after unlocking; ThreadSanitizer saw the notify race the
// destructor).
TEST(DecodeBatcherTest, DestroyedRightAfterItsLastBatchIsDone) {
  for (int i = 0; i < 100; ++i) {
    std::thread runner;
    DecodeBatcher* batcher_ptr = nullptr;
    auto batcher = std::make_unique<DecodeBatcher>(
        absl::ZeroDuration(), 8, /*when_busy=*/true, /*max_running=*/1,
        [&](DecodeBatcher::Batch, bool) {
          runner = std::thread([&batcher_ptr] { batcher_ptr->BatchDone(); });
        });
    batcher_ptr = batcher.get();
    // Idle, no window: handed on from this thread, whose flush starts the runner.
    ASSERT_TRUE(batcher->Add(nullptr, 1).ok());
    batcher.reset();  // Stop() waits for BatchDone, then the batcher goes
    runner.join();
  }
}

}  // namespace
}  // namespace flashserve
