// AttentionRuntime with a fake backend: status codes for deadline, cancellation, overload and
// shutdown, and the response it fills.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"
#include "runtime_harness.h"

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
  absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) override {
    runs++;
    if (gate.valid()) gate.wait();
    if (!fail.ok()) return fail;
    const TensorBytes* inputs[3] = {&job.tensors.q, &job.tensors.k, &job.tensors.v};
    for (int i = 0; i < 3; ++i) {  // what a backend reading the inputs where they are would see
      seen_bytes[i].clear();
      for (std::string_view piece : inputs[i]->pieces) seen_bytes[i] += piece;
      seen_pieces[i] = inputs[i]->pieces.size();
    }
    // Recognizable output: every element = problem.seqlen_k.
    const AttentionProblem& problem = job.problem;
    auto* out = reinterpret_cast<float*>(job.tensors.o.data);
    for (int64_t i = 0; i < problem.q_elements(); ++i) out[i] = float(problem.seqlen_k);
    auto* lse = reinterpret_cast<float*>(job.tensors.lse.data);
    for (int64_t i = 0; i < problem.lse_elements(); ++i) lse[i] = -1.f;
    output_kind = job.tensors.o.kind;
    timing->compute_us = 7;
    *kernel = "fake_kernel";
    return absl::OkStatus();
  }
  bool ReadsDirectly(const TensorBytes& t) const override { return reads_pieces || t.contiguous(); }
  bool WritesDirectly(MemoryKind kind) const override { return writes_heap; }
  std::atomic<int> runs{0};
  std::shared_future<void> gate;
  absl::Status fail;
  bool reads_pieces = false;  // reads inputs in many pieces (CUDA: page-locked ones)
  bool writes_heap = true;    // false: wants its outputs in request buffers (CUDA)
  std::string seen_bytes[3];  // the last job's inputs, joined
  size_t seen_pieces[3] = {0, 0, 0};
  MemoryKind output_kind = MemoryKind::kHeap;

 private:
  BackendCapabilities caps_;
};

using runtime_testing::Request;

struct Harness : runtime_testing::Harness<FakeBackend> {
  explicit Harness(int capacity = 4) : runtime_testing::Harness<FakeBackend>(capacity) {}
  /// Submits `call` (its done is replaced) and waits for the answer.
  absl::Status Run(AttentionRuntime::Call call) {
    auto promise = std::make_shared<std::promise<absl::Status>>();
    call.done = [promise](const absl::Status& s) { promise->set_value(s); };
    runtime->Submit(std::move(call));
    return promise->get_future().get();
  }
};

// A request whose tensor bytes travel outside it, as the zero-copy edges send them: `header` has
// dtype and shape but no data; `data` holds the bytes (a pattern that differs per tensor).
struct ExternalRequest {
  explicit ExternalRequest(v1::AttentionRequest request, int seed) : header(std::move(request)) {
    v1::Tensor* tensors[3] = {header.mutable_q(), header.mutable_k(), header.mutable_v()};
    for (int i = 0; i < 3; ++i) {
      data[i] = tensors[i]->data();
      for (size_t j = 0; j < data[i].size(); ++j) data[i][j] = char(j * seed + i);
      tensors[i]->clear_data();
    }
  }
  /// A call for it, each tensor in three pieces split anywhere, the outputs left in buffers
  /// that land in `*buffers`.
  AttentionRuntime::Call Call(v1::AttentionResponse* response,
                              std::shared_ptr<IoBuffers>* buffers) const {
    AttentionRuntime::Call call;
    call.request = &header;
    call.response = response;
    call.received = absl::Now();
    for (int i = 0; i < 3; ++i) {
      const std::string_view all(data[i]);
      call.inputs[i].kind = MemoryKind::kPageLocked;
      call.inputs[i].pieces = {all.substr(0, 7), all.substr(7, 1), all.substr(8)};
    }
    call.outputs_in_buffers = true;
    call.buffers_out = buffers;
    return call;
  }
  v1::AttentionRequest header;
  std::string data[3];
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

TEST(AttentionRuntime, DeadlineWinsOverCancelledInTheQueue) {
  // gRPC reports a call whose deadline passed as cancelled too; the answer (and the metric) must
  // say DEADLINE_EXCEEDED.
  Harness h;
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  absl::Status s =
      h.Submit(&request, &response, absl::Now() - absl::Milliseconds(1), [] { return true; }).get();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
}

// The zero-copy path: tensor data outside the request, in pieces the backend cannot read as they
// are: the runtime stages them into request buffers; the result stays in the buffers.
TEST(AttentionRuntime, ExternalInputsAreStagedAndOutputStaysInBuffers) {
  Harness h;
  v1::AttentionRequest full = Request();
  full.set_return_lse(true);
  const ExternalRequest external(full, 3);
  const std::string* data = external.data;
  std::shared_ptr<IoBuffers> kept;
  v1::AttentionResponse response;
  ASSERT_TRUE(h.Run(external.Call(&response, &kept)).ok());
  ASSERT_NE(kept, nullptr);
  EXPECT_FALSE(kept->pinned());  // the fake backend has no pinned pool
  ASSERT_TRUE(kept->has_inputs());
  EXPECT_EQ(std::string(kept->q(), data[0].size()), data[0]);
  EXPECT_EQ(std::string(kept->v(), data[2].size()), data[2]);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(h.backend.seen_bytes[i], data[i]);
    EXPECT_EQ(h.backend.seen_pieces[i], 1u);  // gathered into one contiguous span
  }
  // Output in the buffers, headers (no data) in the response.
  float first;
  std::memcpy(&first, kept->o(), 4);
  EXPECT_EQ(first, 5.f);
  EXPECT_EQ(kept->lse()[0], -1.f);
  EXPECT_TRUE(response.out().data().empty());
  EXPECT_EQ(response.out().shape_size(), 4);
  EXPECT_EQ(response.lse().shape_size(), 3);
  EXPECT_EQ(response.kernel(), "fake_kernel");
}

// The same request when the backend reads the pieces where they are (CUDA with the receive
// arena): the buffers get room for the outputs only and nothing is copied on the host.
TEST(AttentionRuntime, InputsReadInPlaceAreNotCopied) {
  for (const bool in_place : {true, false}) {
    Harness h;
    h.backend.reads_pieces = in_place;
    const ExternalRequest external(Request(), 5);
    std::shared_ptr<IoBuffers> kept;
    v1::AttentionResponse response;
    ASSERT_TRUE(h.Run(external.Call(&response, &kept)).ok()) << in_place;
    ASSERT_NE(kept, nullptr);
    EXPECT_EQ(kept->has_inputs(), !in_place);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(h.backend.seen_bytes[i], external.data[i]);
      EXPECT_EQ(h.backend.seen_pieces[i], in_place ? 3u : 1u);
    }
    // o is 3 * 2 * 4 floats (one 256-byte unit), no lse; the inputs would need three more units.
    EXPECT_EQ(kept->layout().total, in_place ? 256u : 4 * 256u);
    float first;
    std::memcpy(&first, kept->o(), 4);
    EXPECT_EQ(first, 5.f);
  }
}

// A backend that writes only to its own buffers (CUDA: page-locked) serving a request whose
// answer goes in the response message (KServe): outputs are staged, then copied into the message.
TEST(AttentionRuntime, OutputsStagedForTheBackendAreCopiedIntoTheResponse) {
  Harness h;
  h.backend.writes_heap = false;
  v1::AttentionRequest request = Request();
  request.set_return_lse(true);
  v1::AttentionResponse response;
  ASSERT_TRUE(h.Submit(&request, &response).get().ok());
  EXPECT_EQ(h.backend.seen_bytes[1], request.k().data());  // inputs read from the message
  ASSERT_EQ(response.out().data().size(), 3u * 2 * 4 * 4);
  float first, lse;
  std::memcpy(&first, response.out().data().data(), 4);
  std::memcpy(&lse, response.lse().data().data(), 4);
  EXPECT_EQ(first, 5.f);
  EXPECT_EQ(lse, -1.f);
}

TEST(AttentionRuntime, ExternalInputsOfTheWrongSizeAreRejectedBeforeAllocation) {
  Harness h;
  const ExternalRequest external(Request(), 2);
  std::shared_ptr<IoBuffers> kept;
  v1::AttentionResponse response;
  AttentionRuntime::Call call = external.Call(&response, &kept);
  call.inputs[1].pieces.back().remove_suffix(1);  // one byte short
  absl::Status s = h.Run(std::move(call));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("k.data: expected 80 bytes"), std::string::npos) << s;
  EXPECT_EQ(kept, nullptr);
  EXPECT_EQ(h.backend.runs.load(), 0);
}

TEST(AttentionRuntime, BackendErrorLeavesNoPartialOutput) {
  Harness h;
  h.backend.fail = absl::ResourceExhaustedError("device memory");
  v1::AttentionRequest request = Request();
  v1::AttentionResponse response;
  EXPECT_EQ(h.Submit(&request, &response).get().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(response.has_out());
}

// The local socket's connection thread waits for done() anyway: with caller_waits the job runs on
// it (no worker hop) when a worker would be idle; without it, on the scheduler's worker.
TEST(AttentionRuntime, CallerWaitsRunsTheJobOnTheCallingThread) {
  Harness h;
  const v1::AttentionRequest request = Request();
  for (const bool caller_waits : {true, false}) {
    v1::AttentionResponse response;
    AttentionRuntime::Call call;
    call.request = &request;
    call.response = &response;
    call.received = absl::Now();
    call.caller_waits = caller_waits;
    auto answered = std::make_shared<std::promise<std::thread::id>>();
    call.done = [answered](const absl::Status& s) {
      EXPECT_TRUE(s.ok()) << s;
      answered->set_value(std::this_thread::get_id());
    };
    std::future<std::thread::id> on = answered->get_future();
    h.runtime->Submit(std::move(call));
    if (caller_waits) {
      ASSERT_EQ(on.wait_for(std::chrono::seconds(0)), std::future_status::ready)
          << "not answered before Submit returned";
      EXPECT_EQ(on.get(), std::this_thread::get_id());
    } else {
      EXPECT_NE(on.get(), std::this_thread::get_id());
    }
  }
}

}  // namespace
}  // namespace flashserve
