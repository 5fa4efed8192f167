// Request handling shared by every edge: validate once, queue, run on the backend, fill the
// response.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/validation.h"
#include "flashserve/v1/attention.pb.h"
#include "metrics/server_metrics.h"
#include "runtime/backend.h"
#include "memory/io_buffers.h"
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

    // Zero-copy edges. The tensors' bytes are not in `request` (its q/k/v data are empty):
    // `data_bytes` are their sizes, validated as data().size() would be, and either
    // - `fill_inputs` copies them into the buffers the runtime allocates once the request is
    //   admitted (the gRPC edge: straight from the receive slices), or
    // - `io` already holds them (the striped stream edge reassembles into IoBuffers).
    // The result then stays in `io`: the response gets out/lse dtype and shape but no data, and
    // the edge sends O and LSE out of io->o() / io->lse().
    int64_t data_bytes[3] = {0, 0, 0};
    std::function<void(const std::shared_ptr<IoBuffers>& io)> fill_inputs;  // may keep io
    std::shared_ptr<IoBuffers> io;
    // With fill_inputs: where the tensors' bytes are (valid until done). When the backend reads
    // them in place (Backend::ReadsInPlace), `io` gets room for the outputs only
    // (!io->has_inputs()), fill_inputs must then copy nothing, and the bytes are read from here.
    const InputPieces* input_pieces[3] = {nullptr, nullptr, nullptr};
    bool inject_device_fault = false;  // test hook, see JobOutput
  };

  /// metrics may be null. max_inflight_bytes (0: no limit) bounds the tensor bytes (inputs and
  /// outputs) of all accepted, unfinished requests; a request that would pass it gets
  /// RESOURCE_EXHAUSTED before its output is allocated.
  AttentionRuntime(Backend* backend, Scheduler* scheduler, ValidationLimits limits,
                   ServerMetrics* metrics = nullptr, int64_t max_inflight_bytes = 0);
  /// Waits (up to 10 s) for calls whose done() is still running on another thread: their
  /// completion wrapper touches this object after handing the answer back.
  ~AttentionRuntime();

  /// Holds a place for a call an edge has received but not yet submitted (it is still parsing
  /// the request): StopAccepting does not turn it away and WaitIdle waits for it. Empty (false)
  /// once the runtime stopped accepting. Released when destroyed unless passed to Submit.
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& other) noexcept : runtime_(std::exchange(other.runtime_, nullptr)) {}
    Admission& operator=(Admission&& other) noexcept;
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;
    ~Admission();
    explicit operator bool() const { return runtime_ != nullptr; }

   private:
    friend class AttentionRuntime;
    explicit Admission(AttentionRuntime* runtime) : runtime_(runtime) {}
    AttentionRuntime* runtime_ = nullptr;
  };
  Admission Admit();

  /// Answers the call through call.done, exactly once (UNAVAILABLE when not accepting, unless
  /// `admission` holds a place for it).
  void Submit(Call call, Admission admission);
  void Submit(Call call);

  /// Live and able to serve: backend healthy and not shutting down.
  bool ready() const { return accepting_.load() && backend_->healthy(); }
  /// Worth keeping: false for good once the backend is unhealthy (a sticky device fault). The
  /// process then drains and exits to be restarted (config/serve_loop.h); /v2/health/live and
  /// KServe ServerLive report this, so a liveness probe restarts it too. Thread-safe.
  bool live() const { return backend_->healthy(); }
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
  void Leave();  // one accepted call answered
  // Runs on a scheduler worker: drops expired/cancelled calls, else starts the backend job.
  void Execute(const AttentionProblem& problem, std::shared_ptr<Call> call, absl::Time enqueued,
               int64_t stage_us);
  // Fills the response from a finished job; the status to answer with.
  absl::Status Finish(const AttentionProblem& problem, const Call& call, absl::Time enqueued,
                      absl::Time started, JobResult result);

  Backend* backend_;
  Scheduler* scheduler_;
  const ValidationLimits limits_;
  ServerMetrics* const metrics_;
  const int64_t max_inflight_bytes_;
  std::atomic<int64_t> inflight_bytes_{0};
  std::atomic<bool> accepting_{true};  // written under idle_mu_
  std::mutex idle_mu_;
  std::condition_variable idle_cv_;
  int64_t outstanding_ = 0;  // admitted or accepted, not yet answered; guarded by idle_mu_
};

}  // namespace flashserve
