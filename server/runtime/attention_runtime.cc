#include "runtime/attention_runtime.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "runtime/tensor_placement.h"

namespace flashserve {
namespace {

// Staged inputs of requests under this size give back the memory they arrived in at once.
constexpr int64_t kReleaseInputsEarlyBytes = int64_t{4} << 20;

void SetTensorHeader(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape) {
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
}

// O and LSE sent in the answer (not in a region) must fit the edge's message limit: with inputs in
// shared memory a small request can ask for an answer past gRPC's 2 GiB, which was computed and
// then failed to send.
absl::Status CheckInlineAnswer(const AttentionRuntime::Call& call, const AttentionProblem& p) {
  if (call.max_inline_answer_bytes <= 0) return absl::OkStatus();
  const int64_t out = call.regions[0].data == nullptr ? p.out_bytes() : 0;
  const int64_t lse =
      call.regions[1].data == nullptr ? p.lse_elements() * int64_t(sizeof(float)) : 0;
  if (out + lse <= call.max_inline_answer_bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the answer would carry ", out + lse, " bytes of O and LSE, past the ",
      call.max_inline_answer_bytes,
      " a gRPC message may hold: put O (and LSE) in a shared-memory region, or split the batch"));
}

}  // namespace

// What an Admission needs once its runtime may be gone.
struct AttentionRuntime::Admission::Core {
  void Leave() {  // one admitted or accepted call answered
    std::lock_guard<std::mutex> lock(mu);
    if (--outstanding == 0) idle_cv.notify_all();
  }

  std::mutex mu;
  std::condition_variable idle_cv;  // outstanding reached 0
  int64_t outstanding = 0;          // admitted or accepted, not yet answered; guarded by mu
};

// One accepted call from validation to its answer. Its scheduler job and backend completion name
// the runtime, and both hold the Job: while it lives, the runtime must.
struct AttentionRuntime::Job {
  explicit Job(JobCount* jobs) : ticket(jobs) {}
  // First, so destroyed last: after the call's and the placement's destructors.
  JobCount::Ticket ticket;
  Call call;
  AttentionProblem problem;
  TensorPlacement placement;
  absl::Time enqueued;
  // How its inputs reached the backend (request_inputs_total), counted once it runs: a call the
  // queue refuses, or that expires or is cancelled there, reached nothing.
  const char* input_path = nullptr;
};

AttentionRuntime::AttentionRuntime(Backend* backend, Scheduler* scheduler, ValidationLimits limits,
                                   ServerMetrics* metrics, int64_t max_inflight_bytes,
                                   ParallelCopier* copier)
    : backend_(backend),
      scheduler_(scheduler),
      copier_(copier),
      limits_(std::move(limits)),
      metrics_(metrics),
      inflight_(std::make_shared<InflightBytes>(max_inflight_bytes)),
      admissions_(std::make_shared<Admission::Core>()) {}

void AttentionRuntime::StopAccepting() {
  // Every job reaches the scheduler through Submit, so this gate is the only one: calls admitted
  // before it still get queued.
  std::lock_guard<std::mutex> lock(admissions_->mu);
  accepting_.store(false);
}

AttentionRuntime::Admission AttentionRuntime::Admit() {
  std::lock_guard<std::mutex> lock(admissions_->mu);
  if (!accepting_.load()) return Admission();
  ++admissions_->outstanding;
  return Admission(admissions_);
}

AttentionRuntime::Admission& AttentionRuntime::Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    if (core_ != nullptr) core_->Leave();
    core_ = std::move(other.core_);
  }
  return *this;
}

AttentionRuntime::Admission::~Admission() {
  if (core_ != nullptr) core_->Leave();
}

void AttentionRuntime::Submit(Call call) { Submit(std::move(call), Admission()); }

bool AttentionRuntime::AdmitBytes(Call& call, int64_t bytes) {
  if (absl::Status s = inflight_->Reserve(bytes); !s.ok()) {
    call.done(s);
    return false;
  }
  auto held = std::make_shared<InflightReservation>(inflight_, bytes);
  if (call.answer_keeps_bytes != nullptr) *call.answer_keeps_bytes = held;
  call.done = [held = std::move(held),
               done = std::move(call.done)](const absl::Status& status) mutable {
    held.reset();  // the edge's copy, if any, keeps the bytes until the answer has left
    done(status);
  };
  return true;
}

void AttentionRuntime::Submit(Call call, Admission admission) {
  if (!admission) {
    admission = Admit();
    if (!admission) {
      call.done(absl::UnavailableError("server is shutting down"));
      return;
    }
  }
  // From here the call counts as outstanding until its done() has returned.
  call.done = [core = std::move(admission.core_),
               done = std::move(call.done)](const absl::Status& status) {
    done(status);
    core->Leave();
  };
  const bool external = !call.inputs[0].empty() || !call.inputs[1].empty() ||
                        !call.inputs[2].empty() || call.io != nullptr;
  int64_t data_bytes[3];
  for (int i = 0; i < 3; ++i) data_bytes[i] = call.inputs[i].size();
  absl::StatusOr<AttentionProblem> problem =
      ValidateAttentionRequest(*call.request, limits_, external ? data_bytes : nullptr);
  if (!problem.ok()) {
    call.done(problem.status());
    return;
  }
  if (absl::Status s = CheckInlineAnswer(call, *problem); !s.ok()) {
    call.done(s);
    return;
  }
  // Admission by bytes: inputs (already received) plus the output this request will allocate.
  if (!AdmitBytes(call, problem->q_bytes() + 2 * problem->kv_bytes() + problem->out_bytes() +
                            problem->lse_elements() * int64_t(sizeof(float)))) {
    return;
  }
  const bool run_inline = backend_->can_launch_now() || call.caller_waits;
  auto job = std::make_shared<Job>(&jobs_);
  job->problem = *problem;
  absl::Status placed = Place(call, job.get());
  if (!placed.ok()) {
    call.done(placed);
    return;
  }
  job->enqueued = absl::Now();
  job->call = std::move(call);
  // The job owns the call; if the scheduler refuses it, the job is destroyed unrun and we answer.
  Scheduler::Job run = [this, job] { Execute(job); };
  // A GPU launch with a stream free is quick: do it here rather than wake a worker for it (and
  // any job of a caller that waits for it anyway).
  absl::Status queued = run_inline ? scheduler_->SubmitOrRunInline(std::move(run))
                                   : scheduler_->Submit(std::move(run));
  if (!queued.ok()) job->call.done(queued);
}

// Outputs named in a region must fit there; LSE only when the request returns it.
absl::Status CheckRegionOutputs(const AttentionRuntime::Call& call, const AttentionProblem& p) {
  const char* names[2] = {"O", "LSE"};
  const int64_t need[2] = {p.out_bytes(), p.lse_elements() * int64_t(sizeof(float))};
  for (int i = 0; i < 2; ++i) {
    const TensorTarget& target = call.regions[i];
    if (target.data == nullptr) continue;
    if (i == 1 && !p.return_lse) {
      return absl::InvalidArgumentError("LSE: a shared-memory output given without return_lse");
    }
    if (int64_t(target.bytes) < need[i]) {
      return absl::InvalidArgumentError(absl::StrCat(names[i], ": shared-memory output of ",
                                                     target.bytes, " bytes, ", need[i], " needed"));
    }
  }
  return absl::OkStatus();
}

absl::Status AttentionRuntime::Place(Call& call, Job* job) {
  const v1::AttentionRequest& request = *call.request;
  RETURN_IF_ERROR(CheckRegionOutputs(call, job->problem));
  TensorPlacementRequest where;
  where.problem = &job->problem;
  const v1::Tensor* messages[3] = {&request.q(), &request.k(), &request.v()};
  for (int i = 0; i < 3; ++i) {
    where.inputs[i] = call.inputs[i].empty() && call.io == nullptr
                          ? TensorBytes::Contiguous(MemoryKind::kHeap, messages[i]->data().data(),
                                                    messages[i]->data().size())
                          : std::move(call.inputs[i]);
  }
  const bool from_receive_buffers = call.inputs_owner != nullptr;
  where.outputs_in_buffers = call.outputs_in_buffers;
  where.io = std::move(call.io);
  where.response = call.response;
  where.regions[0] = call.regions[0];
  where.regions[1] = call.regions[1];
  ASSIGN_OR_RETURN(job->placement, PlaceTensors(std::move(where), *backend_, copier_));
  if (call.shm_input_path != nullptr) {
    job->input_path = call.shm_input_path;
  } else if (from_receive_buffers) {
    job->input_path = job->placement.inputs_copied ? "copied" : "in_place";
  }
  // Staged inputs no longer need the memory they arrived in. Small requests give it back now
  // (flat RSS under mixed traffic); large ones at the end, so freeing hundreds of MB of read
  // buffers never delays their launch.
  if (job->placement.inputs_copied && job->problem.q_bytes() < kReleaseInputsEarlyBytes) {
    call.inputs_owner.reset();
  }
  if (call.buffers_out != nullptr) *call.buffers_out = job->placement.io;
  return absl::OkStatus();
}

AttentionRuntime::~AttentionRuntime() {
  // After a drain that ran out, CancelRunning makes queued jobs answer at once and CPU work stop;
  // what is left is a launch the device has not completed.
  jobs_.WaitForNone("attention runtime");
}

bool AttentionRuntime::WaitIdle(absl::Time deadline) {
  if (!scheduler_->WaitIdle(deadline)) return false;
  Admission::Core& core = *admissions_;
  std::unique_lock<std::mutex> lock(core.mu);
  while (core.outstanding > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    core.idle_cv.wait_for(lock, absl::ToChronoMicroseconds(left));
  }
  return true;
}

void AttentionRuntime::Execute(std::shared_ptr<Job> job) {
  Call& call = job->call;
  const absl::Time started = absl::Now();
  // Deadline first: gRPC also reports a call whose deadline passed as cancelled, and it is the
  // deadline the client should hear about (and the metrics count).
  if (started >= call.deadline) {
    call.done(absl::DeadlineExceededError(
        absl::StrCat("deadline expired after ", absl::ToInt64Microseconds(started - job->enqueued),
                     " us in the queue; not run")));
    return;
  }
  if (Cancelled(call)) {
    call.done(absl::CancelledError(CancelledBy()));
    return;
  }
  if (metrics_ != nullptr && job->input_path != nullptr) metrics_->RecordInputPath(job->input_path);
  const AttentionProblem& problem = job->problem;
  const auto dtype = static_cast<v1::DType>(problem.dtype);
  SetTensorHeader(call.response->mutable_out(), dtype,
                  {problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim});
  if (problem.return_lse) {
    SetTensorHeader(call.response->mutable_lse(), v1::FLOAT32,
                    {problem.batch, problem.heads_q, problem.seqlen_q});
  }
  BackendJob backend_job;
  backend_job.problem = problem;
  // The input pieces move (a large request has thousands); Finish needs only the outputs.
  JobTensors& placed = job->placement.tensors;
  backend_job.tensors.q = std::move(placed.q);
  backend_job.tensors.k = std::move(placed.k);
  backend_job.tensors.v = std::move(placed.v);
  backend_job.tensors.o = placed.o;
  backend_job.tensors.lse = placed.lse;
  backend_job.deadline = call.deadline;
  backend_job.cancelled = [this, &call] { return Cancelled(call); };
  backend_job.inject = call.inject;
  if (call.ran != nullptr) call.ran->store(true);
  // The job (request, response, buffers, input owner) stays alive until its done() runs, so the
  // backend may keep reading and writing its tensors after this worker returns.
  backend_->RunAsync(std::move(backend_job), [this, job, started](JobResult result) {
    result.timing.stage_us += job->placement.stage_us;
    const absl::Status status = Finish(*job, started, std::move(result));
    job->call.inputs_owner.reset();
    job->call.done(status);
  });
}

bool AttentionRuntime::Cancelled(const Call& call) const {
  return cancelling_.load() || (call.cancelled && call.cancelled());
}

// After CancelRunning gRPC cancels every call too: the shutdown is the reason then.
const char* AttentionRuntime::CancelledBy() const {
  return cancelling_.load() ? "cancelled by the server's shutdown (grace period over)"
                            : "cancelled by the client";
}

absl::Status AttentionRuntime::Finish(const Job& job, absl::Time started, JobResult result) {
  const Call& call = job.call;
  const AttentionProblem& problem = job.problem;
  v1::AttentionResponse* response = call.response;
  // A client that went away while its job ran gets CANCELLED (counted and logged as such),
  // not an OK nobody reads; so does a job the backend stopped for it.
  if (result.status.code() == absl::StatusCode::kCancelled ||
      (result.status.ok() && Cancelled(call))) {
    const absl::string_view stopped = result.status.message();  // e.g. "stopped after 12 us"
    result.status = absl::CancelledError(
        absl::StrCat(CancelledBy(), " while computing", stopped.empty() ? "" : "; ", stopped));
  }
  if (!result.status.ok()) {
    response->clear_out();
    response->clear_lse();
    return result.status;
  }
  if (job.placement.outputs_to_response) CopyOutputsToResponse(problem, job.placement, response);
  CopyOutputsToRegions(job.placement);  // before the answer: the region holds the result then
  const PhaseTiming& phases = result.timing;
  v1::Timing* timing = response->mutable_timing();
  timing->set_queue_us(absl::ToInt64Microseconds(started - job.enqueued));
  timing->set_stage_us(phases.stage_us);
  timing->set_h2d_us(phases.h2d_us);
  timing->set_compute_us(phases.compute_us);
  timing->set_d2h_us(phases.d2h_us);
  timing->set_total_us(absl::ToInt64Microseconds(absl::Now() - call.received));
  response->set_kernel(result.kernel);
  response->set_request_id(call.request->request_id());
  if (metrics_ != nullptr) RecordPhases(problem, result, timing->queue_us());
  return absl::OkStatus();
}

void AttentionRuntime::RecordPhases(const AttentionProblem& problem, const JobResult& result,
                                    int64_t queue_us) {
  const PhaseTiming& phases = result.timing;
  metrics_->RecordPhase(Phase::kQueue, queue_us * 1e-6);
  if (phases.h2d_us > 0 || phases.d2h_us > 0) {
    metrics_->RecordPhase(Phase::kH2D, phases.h2d_us * 1e-6);
    metrics_->RecordPhase(Phase::kD2H, phases.d2h_us * 1e-6);
  }
  metrics_->RecordPhase(Phase::kCompute, phases.compute_us * 1e-6);
  if (phases.compute_us > 0) {
    metrics_->ObserveKernel(result.kernel, kernels::attention_flops(problem.params()) /
                                               (phases.compute_us * 1e-6) / 1e12);
  }
}

}  // namespace flashserve
