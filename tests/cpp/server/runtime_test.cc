// AttentionRuntime with a fake backend: status codes for deadline, cancellation, overload and
// shutdown, and the response it fills.
#include <atomic>
#include <cstring>
#include <future>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"

namespace flashserve {
namespace {

class FakeBackend final : public Backend {
 public:
  FakeBackend() {
    caps_.name = "fake";
    caps_.dtypes = {kernels::DType::kFloat32};
    caps_.max_head_dim = 8;
  }
  const BackendCapabilities& capabilities() const override { return caps_; }
  absl::Status Run(const AttentionProblem& problem, const JobOutput& output, PhaseTiming* timing,
                   std::string* kernel) override {
    runs++;
    if (gate.valid()) gate.wait();
    if (!fail.ok()) return fail;
    // Recognizable output: every element = problem.seqlen_k.
    auto* out = static_cast<float*>(output.out);
    for (int64_t i = 0; i < problem.q_elements(); ++i) out[i] = float(problem.seqlen_k);
    for (int64_t i = 0; i < problem.lse_elements(); ++i) output.lse[i] = -1.f;
    timing->compute_us = 7;
    *kernel = "fake_kernel";
    return absl::OkStatus();
  }
  std::atomic<int> runs{0};
  std::shared_future<void> gate;
  absl::Status fail;

 private:
  BackendCapabilities caps_;
};

void SetTensor(v1::Tensor* t, std::vector<int64_t> shape) {
  t->set_dtype(v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  t->set_data(std::string(size_t(n) * 4, '\0'));
}

v1::AttentionRequest Request() {
  v1::AttentionRequest r;
  SetTensor(r.mutable_q(), {1, 3, 2, 4});
  SetTensor(r.mutable_k(), {1, 5, 1, 4});
  SetTensor(r.mutable_v(), {1, 5, 1, 4});
  r.set_request_id("abc");
  return r;
}

struct Harness {
  explicit Harness(int capacity = 4) {
    scheduler = std::move(*Scheduler::Create({capacity, 1}));
    ValidationLimits limits;
    limits.dtypes = backend.capabilities().dtypes;
    limits.max_head_dim = 8;
    limits.backend_name = "fake";
    runtime = std::make_unique<AttentionRuntime>(&backend, scheduler.get(), limits);
  }
  // Submits and returns a future for the status.
  std::future<absl::Status> Submit(const v1::AttentionRequest* request,
                                   v1::AttentionResponse* response,
                                   absl::Time deadline = absl::InfiniteFuture(),
                                   std::function<bool()> cancelled = {}) {
    auto promise = std::make_shared<std::promise<absl::Status>>();
    AttentionRuntime::Call call;
    call.request = request;
    call.response = response;
    call.received = absl::Now();
    call.deadline = deadline;
    call.cancelled = std::move(cancelled);
    call.done = [promise](const absl::Status& s) { promise->set_value(s); };
    runtime->Submit(std::move(call));
    return promise->get_future();
  }
  FakeBackend backend;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<AttentionRuntime> runtime;
};

TEST(AttentionRuntime, FillsResponse) {
  Harness h;
  v1::AttentionRequest request = Request();
  request.set_return_lse(true);
  v1::AttentionResponse response;
  ASSERT_TRUE(h.Submit(&request, &response).get().ok());
  EXPECT_EQ(response.out().dtype(), v1::FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(response.out().shape().begin(), response.out().shape().end()),
            (std::vector<int64_t>{1, 3, 2, 4}));
  ASSERT_EQ(response.out().data().size(), 3u * 2 * 4 * 4);
  float first;
  std::memcpy(&first, response.out().data().data(), 4);
  EXPECT_EQ(first, 5.f);
  EXPECT_EQ(std::vector<int64_t>(response.lse().shape().begin(), response.lse().shape().end()),
            (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(response.lse().dtype(), v1::FLOAT32);
  EXPECT_EQ(response.kernel(), "fake_kernel");
  EXPECT_EQ(response.request_id(), "abc");
  EXPECT_EQ(response.timing().compute_us(), 7);
  EXPECT_GE(response.timing().total_us(), response.timing().compute_us());
}

TEST(AttentionRuntime, NoLseUnlessAsked) {
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  ASSERT_TRUE(h.Submit(&request, &response).get().ok());
  EXPECT_FALSE(response.has_lse());
}

TEST(AttentionRuntime, InvalidRequestAnsweredWithoutRunning) {
  Harness h;
  v1::AttentionRequest request = Request();
  request.mutable_k()->set_shape(3, 5);
  v1::AttentionResponse response;
  EXPECT_EQ(h.Submit(&request, &response).get().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(h.backend.runs.load(), 0);
}

TEST(AttentionRuntime, ExpiredDeadlineIsNotRun) {
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  absl::Status s = h.Submit(&request, &response, absl::Now() - absl::Milliseconds(1)).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.backend.runs.load(), 0);
}

TEST(AttentionRuntime, DeadlinePassingInQueueIsNotRun) {
  Harness h;
  std::promise<void> release;
  h.backend.gate = release.get_future().share();
  v1::AttentionRequest request = Request();
  v1::AttentionResponse first_response, second_response;
  auto first = h.Submit(&request, &first_response);  // holds the only worker
  while (h.backend.runs.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto second = h.Submit(&request, &second_response, absl::Now() + absl::Milliseconds(30));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  release.set_value();
  EXPECT_TRUE(first.get().ok());
  EXPECT_EQ(second.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(h.backend.runs.load(), 1);
}

TEST(AttentionRuntime, CancelledIsNotRun) {
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  absl::Status s = h.Submit(&request, &response, absl::InfiniteFuture(), [] { return true; }).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(h.backend.runs.load(), 0);
}

TEST(AttentionRuntime, OverloadIsResourceExhausted) {
  Harness h(/*capacity=*/2);
  std::promise<void> release;
  h.backend.gate = release.get_future().share();
  v1::AttentionRequest request = Request();
  std::vector<v1::AttentionResponse> responses(4);
  std::vector<std::future<absl::Status>> results;
  results.push_back(h.Submit(&request, &responses[0]));
  while (h.backend.runs.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (int i = 1; i < 4; ++i) results.push_back(h.Submit(&request, &responses[i]));
  // The fourth finds the queue (capacity 2) full and is answered at once.
  EXPECT_EQ(results[3].wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(results[3].get().code(), absl::StatusCode::kResourceExhausted);
  release.set_value();
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(results[i].get().ok());
}

TEST(AttentionRuntime, ShutdownIsUnavailable) {
  Harness h;
  h.runtime->StopAccepting();
  EXPECT_FALSE(h.runtime->ready());
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  EXPECT_EQ(h.Submit(&request, &response).get().code(), absl::StatusCode::kUnavailable);
}

TEST(AttentionRuntime, BackendErrorLeavesNoPartialOutput) {
  Harness h;
  h.backend.fail = absl::ResourceExhaustedError("device memory");
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  EXPECT_EQ(h.Submit(&request, &response).get().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(response.has_out());
}

}  // namespace
}  // namespace flashserve
