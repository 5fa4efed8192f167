// Request handling shared by every edge: validate once, queue, run on the backend, fill the
// response.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/validation.h"
#include "common/process_health.h"
#include "flashserve/v1/attention.pb.h"
#include "memory/io_buffers.h"
#include "memory/parallel_copy.h"
#include "memory/shm_regions.h"
#include "memory/tensor_bytes.h"
#include "metrics/server_metrics.h"
#include "runtime/backend.h"
#include "runtime/inflight_bytes.h"
#include "runtime/job_count.h"
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
    // Set (may be null) when the job is handed to the backend, which may then read the inputs and
    // write the outputs. A call done with it unset never ran: refused (busy, queue full), expired
    // or cancelled before it started, its inputs as they were (the striped edge keeps the session
    // so that Compute can be retried).
    std::atomic<bool>* ran = nullptr;

    // Where Q, K and V arrived; left empty: in the request's data fields (heap). With inputs
    // given, the request's q/k/v data fields are ignored (they are empty on zero-copy edges).
    TensorBytes inputs[3];
    // Keeps the memory of `inputs` alive (e.g. gRPC's receive slices); the runtime drops it as
    // soon as the inputs are no longer read: after they were staged, or when the call is done.
    std::shared_ptr<void> inputs_owner;
    // O and LSE stay in request buffers (`io`) that the edge sends as slices, instead of the
    // response message's data fields (the response then gets their dtype and shape only).
    bool outputs_in_buffers = false;
    // In: buffers already holding the inputs (inputs[] point into them) with room for the
    // outputs (the striped edge), or null. Out (outputs_in_buffers): the buffers O and LSE are in.
    std::shared_ptr<IoBuffers> io;
    // Where the runtime stores `io` once placed, before done() (may be null): the edge sends O
    // and LSE from there.
    std::shared_ptr<IoBuffers>* buffers_out = nullptr;
    // Where the runtime stores the call's --max_inflight_bytes reservation once admitted (may be
    // null: it ends before done()): an edge whose answer gRPC may hold unsent keeps the bytes
    // counted until the answer has left (edge/grpc/live_calls.h).
    std::shared_ptr<void>* answer_keeps_bytes = nullptr;
    // > 0: the most bytes of O and LSE the answer may carry inline (not in a region): gRPC sends
    // no message past 2 GiB, so a larger answer is refused before it is computed.
    int64_t max_inline_answer_bytes = 0;
    InjectedFault inject = InjectedFault::kNone;  // test hook, see BackendJob
    // O and LSE into a client's shared-memory region (data null: the usual way); at least the
    // output's size. The edge holds the region's lease (memory/shm_regions.h) until done() and
    // gives it back before it answers; done() comes after the output is complete there.
    TensorTarget regions[2];
    // Set when Q, K and V come from a client's region: "shm_system" or "shm_cuda" (the
    // request_inputs_total path label).
    const char* shm_input_path = nullptr;
    // The submitting thread waits for done() anyway (the local socket's connection thread): the
    // job runs on it when a scheduler worker would be idle, on any backend, instead of waking a
    // worker (a hop each way). Otherwise only launches the backend says are quick run inline.
    bool caller_waits = false;
  };

  /// metrics may be null. max_inflight_bytes (0: no limit) bounds the tensor bytes (inputs and
  /// outputs) of all accepted, unfinished requests; a request that would pass it gets
  /// RESOURCE_EXHAUSTED before its output is allocated.
  /// `copier` (may be null: copies on the calling thread) stages large requests' inputs.
  AttentionRuntime(Backend* backend, Scheduler* scheduler, ValidationLimits limits,
                   ServerMetrics* metrics = nullptr, int64_t max_inflight_bytes = 0,
                   ParallelCopier* copier = nullptr);
  /// Waits, without a bound, for every accepted job to end: a queued job runs Execute on this
  /// object, and the backend's completion and the call's done() wrapper touch it too. A device
  /// that never completes a launch holds it forever; the process's shutdown limit ends that
  /// (ExitIfShutdownOutlasts, config/serve_loop.h). Admissions are not waited for: they may
  /// outlive the runtime.
  ~AttentionRuntime();

  /// Holds a place for a call an edge has received but not yet submitted (it is still parsing
  /// the request): StopAccepting does not turn it away and WaitIdle waits for it. Empty (false)
  /// once the runtime stopped accepting. Released when destroyed unless passed to Submit. May
  /// outlive the runtime (a DecodeStep's answer keeps its own until gRPC drops the slices).
  class Admission {
   public:
    Admission() = default;
    Admission(Admission&& other) noexcept : core_(std::move(other.core_)) {}
    Admission& operator=(Admission&& other) noexcept;
    Admission(const Admission&) = delete;
    Admission& operator=(const Admission&) = delete;
    ~Admission();
    explicit operator bool() const { return core_ != nullptr; }

   private:
    friend class AttentionRuntime;
    struct Core;  // attention_runtime.cc
    explicit Admission(std::shared_ptr<Core> core) : core_(std::move(core)) {}
    std::shared_ptr<Core> core_;  // shared, not an AttentionRuntime*: see above
  };
  Admission Admit();

  /// Answers the call through call.done, exactly once (UNAVAILABLE when not accepting, unless
  /// `admission` holds a place for it).
  void Submit(Call call, Admission admission);
  void Submit(Call call);

  /// Live and able to serve: backend healthy and not shutting down.
  bool ready() const { return accepting_.load() && live(); }
  /// Worth keeping: false for good once the backend is unhealthy (a sticky device fault) or the
  /// process is broken otherwise (common/process_health.h: gRPC stopped accepting). The process
  /// then drains and exits to be restarted (config/serve_loop.h); /v2/health/live and KServe
  /// ServerLive report this, so a liveness probe restarts it too. Thread-safe.
  bool live() const { return backend_->healthy() && !ProcessBroken(); }
  /// Refuse new work with UNAVAILABLE from now on (work already queued still runs).
  void StopAccepting();
  /// The shutdown's grace period is over: calls not yet answered are cancelled (running CPU work
  /// stops), and their answers and log lines name the server, not the client, as the reason.
  void CancelRunning() { cancelling_.store(true); }
  /// Waits until every accepted request has been answered (queued, running and, on an
  /// asynchronous backend, still on the device); false if `deadline` came first.
  bool WaitIdle(absl::Time deadline);

  const ValidationLimits& limits() const { return limits_; }
  Backend& backend() { return *backend_; }
  Scheduler& scheduler() { return *scheduler_; }
  ServerMetrics* metrics() { return metrics_; }
  /// Clients' shared-memory regions the edges resolve references in (null: none). Set once,
  /// before the edges start; must outlive the runtime's calls.
  void set_shm_regions(ShmRegistry* regions) { shm_regions_ = regions; }
  ShmRegistry* shm_regions() { return shm_regions_; }
  int64_t inflight_bytes() const { return inflight_->held(); }
  /// The count --max_inflight_bytes bounds, for calls that do not go through Submit (the
  /// Sequences API: CallHold reserves there by Submit's rule and gives the bytes back when
  /// answered, even after the runtime is gone).
  std::shared_ptr<InflightBytes> inflight_budget() const { return inflight_; }

 private:
  struct Job;  // one accepted call with its placed tensors (attention_runtime.cc)
  // Runs on a scheduler worker: drops expired/cancelled calls, else starts the backend job.
  void Execute(std::shared_ptr<Job> job);
  // Whether nobody wants the call's answer any more, and who said so (for its message).
  bool Cancelled(const Call& call) const;
  const char* CancelledBy() const;
  // Fills the response from a finished job; the status to answer with.
  absl::Status Finish(const Job& job, absl::Time started, JobResult result);

  // Counts the call against --max_inflight_bytes; false (answered) when over it.
  bool AdmitBytes(Call& call, int64_t bytes);
  // Decides where the job's tensors are (runtime/tensor_placement.h), staging them if needed.
  absl::Status Place(Call& call, Job* job);
  void RecordPhases(const AttentionProblem& problem, const JobResult& result, int64_t queue_us);

  Backend* backend_;
  Scheduler* scheduler_;
  ParallelCopier* const copier_;
  const ValidationLimits limits_;
  ServerMetrics* const metrics_;
  ShmRegistry* shm_regions_ = nullptr;
  const std::shared_ptr<InflightBytes> inflight_;  // --max_inflight_bytes
  std::atomic<bool> accepting_{true};    // written under admissions_->mu
  std::atomic<bool> cancelling_{false};  // CancelRunning was called
  // The count of calls admitted or accepted and not yet answered, with its lock: shared with
  // every Admission, so that one released after the runtime is destroyed still finds them.
  const std::shared_ptr<Admission::Core> admissions_;
  JobCount jobs_;  // Jobs alive (each holds a ticket)
};

}  // namespace flashserve
