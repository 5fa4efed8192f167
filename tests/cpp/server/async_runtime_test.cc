// AttentionRuntime over an asynchronous backend (the CUDA backend's shape, faked): RunAsync returns
// at once and the job completes later on another thread. The scheduler worker is free meanwhile,
// WaitIdle waits for jobs still "on the device", admission bytes are released on completion, and an
// OOM-like failure leaves the next request unaffected.
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"
#include "runtime_harness.h"

namespace flashserve {
namespace {

/// Completes jobs on its own "completion" thread when the test releases them.
class AsyncFakeBackend final : public Backend {
 public:
  AsyncFakeBackend() {
    caps_.name = "fake";
    caps_.dtypes = {kernels::DType::kFloat32};
    caps_.max_head_dim = 8;
    completer_ = std::thread([this] { Loop(); });
  }
  ~AsyncFakeBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      exiting_ = true;
    }
    cv_.notify_all();
    completer_.join();
  }
  const BackendCapabilities& capabilities() const override { return caps_; }
  absl::Status Run(const BackendJob&, PhaseTiming*, std::string*) override {
    return absl::InternalError("synchronous Run must not be used");
  }
  void RunAsync(BackendJob job, JobDone done) override {
    if (job.problem.seqlen_k == 13) {  // "does not fit in device memory"
      JobResult result;
      result.status = absl::ResourceExhaustedError("GPU 0 out of memory");
      done(std::move(result));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({job, std::move(done)});
    launched_++;
    cv_.notify_all();
  }
  /// Lets `n` queued jobs complete.
  void Release(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    releases_ += n;
    cv_.notify_all();
  }
  int launched() {
    std::lock_guard<std::mutex> lock(mu_);
    return launched_;
  }
  void WaitLaunched(int n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return launched_ >= n; });
  }

 private:
  struct Pending {
    BackendJob job;
    JobDone done;
  };
  void Loop() {
    for (;;) {
      Pending pending;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return exiting_ || (releases_ > 0 && !pending_.empty()); });
        if (pending_.empty() || releases_ == 0) return;
        pending = std::move(pending_.front());
        pending_.pop_front();
        releases_--;
      }
      const BackendJob& job = pending.job;
      auto* out = reinterpret_cast<float*>(job.tensors.o.data);
      for (int64_t i = 0; i < job.problem.q_elements(); ++i) out[i] = float(job.problem.seqlen_k);
      JobResult result;
      result.timing.h2d_us = 1;
      result.timing.compute_us = 2;
      result.timing.d2h_us = 3;
      result.kernel = "async_fake";
      pending.done(std::move(result));
    }
  }
  BackendCapabilities caps_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  int launched_ = 0, releases_ = 0;
  bool exiting_ = false;
  std::thread completer_;
};

using runtime_testing::Request;

// Jobs still "on the device" at the end of a test are let go before the runtime goes away.
struct Harness : runtime_testing::Harness<AsyncFakeBackend> {
  explicit Harness(int capacity = 8, int64_t max_inflight_bytes = 0)
      : runtime_testing::Harness<AsyncFakeBackend>(capacity, max_inflight_bytes) {}
  ~Harness() {
    backend.Release(1000);
    if (runtime != nullptr) runtime->WaitIdle(absl::Now() + absl::Seconds(10));
  }
};

TEST(AsyncRuntime, OneWorkerLaunchesManyJobsWithoutWaitingForCompletion) {
  Harness h;
  v1::AttentionRequest request = Request();
  std::vector<v1::AttentionResponse> responses(4);
  std::vector<std::future<absl::Status>> results;
  for (auto& response : responses) results.push_back(h.Submit(&request, &response));
  // A single scheduler worker launched all four while none has completed.
  h.backend.WaitLaunched(4);
  EXPECT_EQ(h.scheduler->queue_depth(), 0);
  for (auto& r : results) {
    EXPECT_EQ(r.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  }
  h.backend.Release(4);
  for (auto& r : results) EXPECT_TRUE(r.get().ok());
  for (const auto& response : responses) {
    EXPECT_EQ(response.kernel(), "async_fake");
    EXPECT_EQ(response.timing().d2h_us(), 3);
    float first;
    std::memcpy(&first, response.out().data().data(), 4);
    EXPECT_EQ(first, 5.f);
  }
}

TEST(AsyncRuntime, WaitIdleWaitsForJobsStillOnTheDevice) {
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  auto result = h.Submit(&request, &response);
  h.backend.WaitLaunched(1);
  EXPECT_TRUE(h.scheduler->WaitIdle(absl::Now() + absl::Seconds(5)));  // the worker is free...
  EXPECT_FALSE(h.runtime->WaitIdle(absl::Now() + absl::Milliseconds(30)));  // ...the call is not
  h.backend.Release(1);
  EXPECT_TRUE(h.runtime->WaitIdle(absl::Now() + absl::Seconds(5)));
  EXPECT_TRUE(result.get().ok());
}

TEST(AsyncRuntime, InflightBytesAreHeldUntilCompletion) {
  v1::AttentionRequest request = Request();
  // One request's bytes: q 96 + k 80 + v 80 + out 96 = 352; the cap admits one at a time.
  Harness h(8, 400);
  v1::AttentionResponse first_response, second_response;
  auto first = h.Submit(&request, &first_response);
  h.backend.WaitLaunched(1);
  EXPECT_EQ(h.runtime->inflight_bytes(), 352);
  EXPECT_EQ(h.Submit(&request, &second_response).get().code(),
            absl::StatusCode::kResourceExhausted);
  h.backend.Release(1);
  EXPECT_TRUE(first.get().ok());
  EXPECT_EQ(h.runtime->inflight_bytes(), 0);
  auto third = h.Submit(&request, &second_response);
  h.backend.Release(1);
  EXPECT_TRUE(third.get().ok());
}

// An edge whose answer may wait unsent (gRPC) keeps the call's bytes counted until it lets go.
TEST(AsyncRuntime, AnEdgeKeepsTheBytesUntilItsAnswerHasLeft) {
  v1::AttentionRequest request = Request();
  Harness h(8, 400);
  v1::AttentionResponse response;
  std::shared_ptr<void> answer_bytes;
  auto done =
      h.Submit(&request, &response, absl::InfiniteFuture(), {},
               [&](AttentionRuntime::Call& call) { call.answer_keeps_bytes = &answer_bytes; });
  h.backend.Release(1);
  ASSERT_TRUE(done.get().ok());
  ASSERT_NE(answer_bytes, nullptr);
  EXPECT_EQ(h.runtime->inflight_bytes(), 352) << "answered, not yet sent: still counted";
  v1::AttentionResponse other;
  EXPECT_EQ(h.Submit(&request, &other).get().code(), absl::StatusCode::kResourceExhausted);
  answer_bytes.reset();  // the answer has left
  EXPECT_EQ(h.runtime->inflight_bytes(), 0);
}

// An answer whose inline O and LSE pass the edge's message limit is refused before it runs.
TEST(AsyncRuntime, AnAnswerPastTheInlineLimitIsRefusedBeforeItRuns) {
  v1::AttentionRequest request = Request();  // O: 96 bytes
  Harness h;
  v1::AttentionResponse response;
  auto refusal = h.Submit(&request, &response, absl::InfiniteFuture(), {},
                          [](AttentionRuntime::Call& call) { call.max_inline_answer_bytes = 95; });
  h.backend.Release(1);  // lets a launch that should not have happened end: a failure, not a hang
  const absl::Status refused = refusal.get();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("shared-memory region"), std::string::npos) << refused;
  EXPECT_EQ(h.backend.launched(), 0);
  EXPECT_EQ(h.runtime->inflight_bytes(), 0);
  auto fits = h.Submit(&request, &response, absl::InfiniteFuture(), {},
                       [](AttentionRuntime::Call& call) { call.max_inline_answer_bytes = 96; });
  h.backend.Release(1);
  EXPECT_TRUE(fits.get().ok());
}

TEST(AsyncRuntime, OutOfDeviceMemoryThenTheNextRequestSucceeds) {
  Harness h;
  v1::AttentionRequest oversized = Request(13), normal = Request();
  v1::AttentionResponse a, b;
  absl::Status s = h.Submit(&oversized, &a).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(a.has_out());
  auto next = h.Submit(&normal, &b);
  h.backend.Release(1);
  EXPECT_TRUE(next.get().ok());
  EXPECT_EQ(h.runtime->inflight_bytes(), 0);
}

TEST(AsyncRuntime, FullQueueIsRefusedAtOnceWhileJobsRun) {
  // Capacity 1: hold the only worker in a plain scheduler job, queue one request, refuse the next.
  Harness h(1);
  std::promise<void> unblock;
  std::shared_future<void> gate = unblock.get_future().share();
  ASSERT_TRUE(h.scheduler->Submit([gate] { gate.wait(); }).ok());
  while (h.scheduler->running() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  v1::AttentionRequest request = Request();
  v1::AttentionResponse queued_response, refused_response;
  auto queued = h.Submit(&request, &queued_response);
  // Answered while the worker is still held: the refusal did not wait for room (the 10 s only
  // bound a wrong wait, as the queued call's answer would).
  auto refused = h.Submit(&request, &refused_response);
  ASSERT_EQ(refused.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(refused.get().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(queued.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
  unblock.set_value();
  h.backend.Release(1);
  EXPECT_TRUE(queued.get().ok());
}

// A job the device completes late, after the server began to destroy the runtime (a drain that
// ran out, then ~Server). The completion runs Finish and done() on the runtime, so the destructor
// must wait for it however long it takes. Before the fix it gave up after 10 s, and the
// completion then ran on freed memory. Runs in a child process: on old code the late completion
// would corrupt the heap of the whole test binary.
int DestroyTheRuntimeUnderALateCompletion() {
  alarm(40);
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  std::future<absl::Status> result = h.Submit(&request, &response);
  h.backend.WaitLaunched(1);
  std::atomic<bool> destroyed{false};
  std::thread teardown([&] {
    h.runtime.reset();
    destroyed = true;
  });
  absl::SleepFor(absl::Milliseconds(10500));  // past the old destructor's 10 s
  if (destroyed.load()) {                     // gone while the job is still on the device
    teardown.join();
    std::_Exit(1);  // before the completion would run on the freed runtime
  }
  h.backend.Release(1);
  teardown.join();
  const absl::Status status = result.get();
  return status.ok() && response.kernel() == "async_fake" ? 0 : 2;
}

TEST(AsyncRuntimeDeathTest, TheRuntimeWaitsForAJobTheDeviceCompletesLate) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::exit(DestroyTheRuntimeUnderALateCompletion()), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve
