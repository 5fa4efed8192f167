// What the AttentionRuntime tests share (runtime_test.cc: a fake backend that computes in Run;
// async_runtime_test.cc: one that completes later on its own thread, as the CUDA backend does):
// small fp32 requests, and a runtime with its scheduler over the test's fake backend.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "runtime/attention_runtime.h"

namespace flashserve::runtime_testing {

inline void SetTensor(v1::Tensor* t, const std::vector<int64_t>& shape) {
  t->set_dtype(v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  t->set_data(std::string(size_t(n) * 4, '\0'));
}

/// q [1, 3, 2, 4], k and v [1, seqlen_k, 1, 4] (two query heads per KV head), fp32 zeros.
inline v1::AttentionRequest Request(int seqlen_k = 5) {
  v1::AttentionRequest r;
  SetTensor(r.mutable_q(), {1, 3, 2, 4});
  SetTensor(r.mutable_k(), {1, seqlen_k, 1, 4});
  SetTensor(r.mutable_v(), {1, seqlen_k, 1, 4});
  r.set_request_id("abc");
  return r;
}

/// A runtime over a FakeBackend (default-constructed; fp32, head_dim <= 8) with `capacity` queue
/// slots and one scheduler worker.
template <typename FakeBackend>
struct Harness {
  explicit Harness(int capacity, int64_t max_inflight_bytes = 0) {
    scheduler = std::move(*Scheduler::Create({capacity, 1}));
    ValidationLimits limits;
    limits.dtypes = backend.capabilities().dtypes;
    limits.max_head_dim = 8;
    limits.backend_name = "fake";
    runtime = std::make_unique<AttentionRuntime>(&backend, scheduler.get(), limits, nullptr,
                                                 max_inflight_bytes);
  }
  /// Submits and returns a future for the status.
  std::future<absl::Status> Submit(
      const v1::AttentionRequest* request, v1::AttentionResponse* response,
      absl::Time deadline = absl::InfiniteFuture(), std::function<bool()> cancelled = {},
      const std::function<void(AttentionRuntime::Call&)>& adjust = {}) {
    auto promise = std::make_shared<std::promise<absl::Status>>();
    AttentionRuntime::Call call;
    call.request = request;
    call.response = response;
    call.received = absl::Now();
    call.deadline = deadline;
    call.cancelled = std::move(cancelled);
    call.done = [promise](const absl::Status& s) { promise->set_value(s); };
    if (adjust) adjust(call);
    runtime->Submit(std::move(call));
    return promise->get_future();
  }

  FakeBackend backend;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<AttentionRuntime> runtime;
};

}  // namespace flashserve::runtime_testing
