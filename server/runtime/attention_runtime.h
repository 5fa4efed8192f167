// Request handling shared by every edge: validate once, queue, run on the backend, fill the
// response.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/validation.h"
#include "flashserve/v1/attention.pb.h"
#include "metrics/server_metrics.h"
#include "runtime/backend.h"
#include "runtime/scheduler.h"

namespace flashserve {

/// Thread-safe. Borrows the backend and scheduler, which must outlive it.
class AttentionRuntime {
 public:
  struct Call {
    const v1::AttentionRequest* request = nullptr;  // valid until done() is called
    v1::AttentionResponse* response = nullptr;      // valid until done() is called
    absl::Time received;                            // when the edge got the request
    absl::Time deadline = absl::InfiniteFuture();
    std::function<bool()> cancelled;                // may be empty
    std::function<void(const absl::Status&)> done;  // called exactly once, maybe inline
  };

  /// metrics may be null. max_inflight_bytes (0: no limit) bounds the tensor bytes (inputs and
  /// outputs) of all accepted, unfinished requests; a request that would pass it gets
  /// RESOURCE_EXHAUSTED before its output is allocated.
  AttentionRuntime(Backend* backend, Scheduler* scheduler, ValidationLimits limits,
                   ServerMetrics* metrics = nullptr, int64_t max_inflight_bytes = 0);
  /// Waits (up to 10 s) for calls whose done() is still running on another thread: their
  /// completion wrapper touches this object after handing the answer back.
  ~AttentionRuntime();

  void Submit(Call call);

  /// Live and able to serve: backend healthy and not shutting down.
  bool ready() const { return accepting_.load() && backend_->healthy(); }
  /// Refuse new work with UNAVAILABLE from now on (work already queued still runs).
  void StopAccepting();
  /// Waits until every accepted request has been answered (queued, running and, on an
  /// asynchronous backend, still on the device); false if `deadline` came first.
  bool WaitIdle(absl::Time deadline);

  const ValidationLimits& limits() const { return limits_; }
  Backend& backend() { return *backend_; }
  Scheduler& scheduler() { return *scheduler_; }
  ServerMetrics* metrics() { return metrics_; }
  int64_t inflight_bytes() const { return inflight_bytes_.load(); }

 private:
  // Runs on a scheduler worker: drops expired/cancelled calls, else starts the backend job.
  void Execute(const AttentionProblem& problem, std::shared_ptr<Call> call, absl::Time enqueued);
  // Fills the response from a finished job; the status to answer with.
  absl::Status Finish(const AttentionProblem& problem, const Call& call, absl::Time enqueued,
                      absl::Time started, JobResult result);

  Backend* backend_;
  Scheduler* scheduler_;
  const ValidationLimits limits_;
  ServerMetrics* const metrics_;
  const int64_t max_inflight_bytes_;
  std::atomic<int64_t> inflight_bytes_{0};
  std::atomic<bool> accepting_{true};
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  int64_t outstanding_ = 0;  // accepted, not yet answered; guarded by idle_mu_
};

}  // namespace flashserve
