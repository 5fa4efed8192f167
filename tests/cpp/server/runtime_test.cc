// AttentionRuntime with a fake backend: status codes for deadline, cancellation, overload and
// shutdown, and the response it fills.
#include <algorithm>
#include <atomic>
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
  absl::Status Run(const AttentionProblem& problem, const JobOutput& output, PhaseTiming* timing,
                   std::string* kernel) override {
    runs++;
    if (gate.valid()) gate.wait();
    if (!fail.ok()) return fail;
    for (int i = 0; i < 3; ++i) {  // what a reading-in-place backend would copy to the device
      read_in_place[i].clear();
      if (output.input_pieces[i] == nullptr) continue;
      for (std::string_view piece : *output.input_pieces[i]) read_in_place[i] += piece;
    }
    inputs_given = problem.q != nullptr;
    // Recognizable output: every element = problem.seqlen_k.
    auto* out = static_cast<float*>(output.out);
    for (int64_t i = 0; i < problem.q_elements(); ++i) out[i] = float(problem.seqlen_k);
    for (int64_t i = 0; i < problem.lse_elements(); ++i) output.lse[i] = -1.f;
    timing->compute_us = 7;
    *kernel = "fake_kernel";
    return absl::OkStatus();
  }
  bool ReadsInPlace(const InputPieces* const[3]) const override { return reads_in_place; }
  std::atomic<int> runs{0};
  std::shared_future<void> gate;
  absl::Status fail;
  bool reads_in_place = false;
  std::string read_in_place[3];  // the last job's input pieces, joined
  bool inputs_given = false;     // the last job's problem.q was set

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
  /// A call for it with data_bytes set; the caller adds fill_inputs (and input_pieces).
  AttentionRuntime::Call Call(v1::AttentionResponse* response) const {
    AttentionRuntime::Call call;
    call.request = &header;
    call.response = response;
    call.received = absl::Now();
    for (int i = 0; i < 3; ++i) call.data_bytes[i] = int64_t(data[i].size());
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

// The zero-copy path: tensor data outside the request, copied by fill_inputs into IoBuffers the
// runtime allocates after admission; the result stays in the buffers.
TEST(AttentionRuntime, ExternalInputsAreFilledAndOutputStaysInBuffers) {
  Harness h;
  v1::AttentionRequest full = Request();
  full.set_return_lse(true);
  const ExternalRequest external(full, 3);
  const std::string* data = external.data;
  std::shared_ptr<IoBuffers> kept;
  v1::AttentionResponse response;
  AttentionRuntime::Call call = external.Call(&response);
  call.fill_inputs = [&](const std::shared_ptr<IoBuffers>& io) {
    kept = io;
    std::memcpy(io->q(), data[0].data(), data[0].size());
    std::memcpy(io->k(), data[1].data(), data[1].size());
    std::memcpy(io->v(), data[2].data(), data[2].size());
  };
  ASSERT_TRUE(h.Run(std::move(call)).ok());
  ASSERT_NE(kept, nullptr);
  EXPECT_FALSE(kept->pinned());  // the fake backend has no pinned pool
  EXPECT_EQ(std::string(kept->q(), data[0].size()), data[0]);
  EXPECT_EQ(std::string(kept->v(), data[2].size()), data[2]);
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

// The same request when the backend reads the inputs in place (CUDA with the receive arena): the
// buffers get room for the outputs only, fill_inputs copies nothing, and the backend sees the
// pieces, not problem.q/k/v.
TEST(AttentionRuntime, InputsReadInPlaceAreNotCopied) {
  for (const bool in_place : {true, false}) {
    Harness h;
    h.backend.reads_in_place = in_place;
    const ExternalRequest external(Request(), 5);
    const std::string* data = external.data;
    InputPieces pieces[3];
    for (int i = 0; i < 3; ++i) {
      const std::string_view all(data[i]);
      pieces[i] = {all.substr(0, 7), all.substr(7, 1), all.substr(8)};  // split anywhere
    }
    std::shared_ptr<IoBuffers> kept;
    int copies = 0;
    v1::AttentionResponse response;
    AttentionRuntime::Call call = external.Call(&response);
    for (int i = 0; i < 3; ++i) call.input_pieces[i] = &pieces[i];
    call.fill_inputs = [&](const std::shared_ptr<IoBuffers>& io) {
      kept = io;
      if (!io->has_inputs()) return;
      copies++;
      char* dest[3] = {io->q(), io->k(), io->v()};
      for (int i = 0; i < 3; ++i) std::memcpy(dest[i], data[i].data(), data[i].size());
    };
    ASSERT_TRUE(h.Run(std::move(call)).ok()) << in_place;
    ASSERT_NE(kept, nullptr);
    EXPECT_EQ(kept->has_inputs(), !in_place);
    EXPECT_EQ(copies, in_place ? 0 : 1);
    EXPECT_EQ(h.backend.inputs_given, !in_place);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(h.backend.read_in_place[i], in_place ? data[i] : "");
    // o is 3 * 2 * 4 floats (one 256-byte unit), no lse; the inputs would need three more units.
    EXPECT_EQ(kept->layout().total, in_place ? 256u : 4 * 256u);
    float first;
    std::memcpy(&first, kept->o(), 4);
    EXPECT_EQ(first, 5.f);
  }
}

TEST(AttentionRuntime, ExternalInputsOfTheWrongSizeAreRejectedBeforeAllocation) {
  Harness h;
  v1::AttentionRequest header = Request();
  for (v1::Tensor* t : {header.mutable_q(), header.mutable_k(), header.mutable_v()}) {
    t->clear_data();
  }
  bool filled = false;
  auto promise = std::make_shared<std::promise<absl::Status>>();
  v1::AttentionResponse response;
  AttentionRuntime::Call call;
  call.request = &header;
  call.response = &response;
  call.data_bytes[0] = 3 * 2 * 4 * 4;
  call.data_bytes[1] = 5 * 4 * 4 - 1;  // one byte short
  call.data_bytes[2] = 5 * 4 * 4;
  call.fill_inputs = [&](const std::shared_ptr<IoBuffers>&) { filled = true; };
  call.done = [promise](const absl::Status& s) { promise->set_value(s); };
  h.runtime->Submit(std::move(call));
  absl::Status s = promise->get_future().get();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("k.data: expected 80 bytes"), std::string::npos) << s;
  EXPECT_FALSE(filled);
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

}  // namespace
}  // namespace flashserve
