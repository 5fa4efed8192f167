#include "runtime/attention_runtime.h"

#include <chrono>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace flashserve {
namespace {

void SetTensorHeader(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape) {
  tensor->set_dtype(dtype);
  tensor->clear_shape();
  for (int64_t d : shape) tensor->add_shape(d);
}

}  // namespace

AttentionRuntime::AttentionRuntime(Backend* backend, Scheduler* scheduler, ValidationLimits limits,
                                   ServerMetrics* metrics, int64_t max_inflight_bytes)
    : backend_(backend),
      scheduler_(scheduler),
      limits_(std::move(limits)),
      metrics_(metrics),
      max_inflight_bytes_(max_inflight_bytes) {}

void AttentionRuntime::StopAccepting() {
  // Every job reaches the scheduler through Submit, so this gate is the only one: calls admitted
  // before it still get queued.
  std::lock_guard<std::mutex> lock(idle_mu_);
  accepting_.store(false);
}

AttentionRuntime::Admission AttentionRuntime::Admit() {
  std::lock_guard<std::mutex> lock(idle_mu_);
  if (!accepting_.load()) return Admission();
  ++outstanding_;
  return Admission(this);
}

AttentionRuntime::Admission& AttentionRuntime::Admission::operator=(Admission&& other) noexcept {
  if (this != &other) {
    if (runtime_ != nullptr) runtime_->Leave();
    runtime_ = std::exchange(other.runtime_, nullptr);
  }
  return *this;
}

AttentionRuntime::Admission::~Admission() {
  if (runtime_ != nullptr) runtime_->Leave();
}

void AttentionRuntime::Leave() {
  std::lock_guard<std::mutex> lock(idle_mu_);
  if (--outstanding_ == 0) idle_cv_.notify_all();
}

void AttentionRuntime::Submit(Call call) { Submit(std::move(call), Admission()); }

void AttentionRuntime::Submit(Call call, Admission admission) {
  if (!admission) {
    admission = Admit();
    if (!admission) {
      call.done(absl::UnavailableError("server is shutting down"));
      return;
    }
  }
  // From here the call counts as outstanding until its done() has returned.
  admission.runtime_ = nullptr;
  call.done = [this, done = std::move(call.done)](const absl::Status& status) {
    done(status);
    Leave();
  };
  const bool external = call.fill_inputs || call.io;
  absl::StatusOr<AttentionProblem> problem =
      ValidateAttentionRequest(*call.request, limits_, external ? call.data_bytes : nullptr);
  if (!problem.ok()) {
    call.done(problem.status());
    return;
  }
  // Admission by bytes: inputs (already received) plus the output this request will allocate.
  const int64_t bytes = problem->q_bytes() + 2 * problem->kv_bytes() + problem->out_bytes() +
                        problem->lse_elements() * int64_t(sizeof(float));
  const int64_t before = inflight_bytes_.fetch_add(bytes);
  if (max_inflight_bytes_ > 0 && before + bytes > max_inflight_bytes_ && before > 0) {
    inflight_bytes_.fetch_sub(bytes);
    call.done(absl::ResourceExhaustedError(
        absl::StrCat("server busy: ", before, " tensor bytes in flight + ", bytes,
                     " for this request exceed --max_inflight_bytes=", max_inflight_bytes_)));
    return;
  }
  int64_t stage_us = 0;
  if (external) {
    if (call.io == nullptr) {
      // The one host copy on the way in, receive slices -> (pinned) request buffers, unless the
      // backend copies the tensors to the device straight from where they arrived.
      const bool in_place =
          call.input_pieces[0] != nullptr && backend_->ReadsInPlace(call.input_pieces);
      call.io = in_place ? IoBuffers::AllocateOutputs(*problem, backend_->staging_pool())
                         : IoBuffers::Allocate(*problem, backend_->staging_pool());
      if (call.io == nullptr) {
        inflight_bytes_.fetch_sub(bytes);
        call.done(absl::ResourceExhaustedError(
            absl::StrCat("cannot allocate ", IoLayout::For(*problem).total,
                         " bytes of host memory for this request")));
        return;
      }
      if (metrics_ != nullptr && call.input_pieces[0] != nullptr) metrics_->RecordInputPath(in_place);
      const absl::Time copy_start = absl::Now();
      call.fill_inputs(call.io);
      stage_us = absl::ToInt64Microseconds(absl::Now() - copy_start);
    }
    if (call.io->has_inputs()) {
      problem->q = call.io->q();
      problem->k = call.io->k();
      problem->v = call.io->v();
    }
  }
  call.done = [this, bytes, done = std::move(call.done)](const absl::Status& status) {
    inflight_bytes_.fetch_sub(bytes);
    done(status);
  };
  const absl::Time enqueued = absl::Now();
  // The job owns the call; if Submit refuses it, the job is destroyed unrun and we answer here.
  auto shared_call = std::make_shared<Call>(std::move(call));
  Scheduler::Job job = [this, shared_call, problem = *problem, enqueued, stage_us] {
    Execute(problem, shared_call, enqueued, stage_us);
  };
  // A GPU launch with a stream free is quick: do it here rather than wake a worker for it.
  absl::Status queued = backend_->can_launch_now() ? scheduler_->SubmitOrRunInline(std::move(job))
                                                   : scheduler_->Submit(std::move(job));
  if (!queued.ok()) shared_call->done(queued);
}

AttentionRuntime::~AttentionRuntime() {
  std::unique_lock<std::mutex> lock(idle_mu_);
  idle_cv_.wait_for(lock, std::chrono::seconds(10), [this] { return outstanding_ == 0; });
}

bool AttentionRuntime::WaitIdle(absl::Time deadline) {
  if (!scheduler_->WaitIdle(deadline)) return false;
  std::unique_lock<std::mutex> lock(idle_mu_);
  while (outstanding_ > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    idle_cv_.wait_for(lock, absl::ToChronoMicroseconds(left));
  }
  return true;
}

void AttentionRuntime::Execute(const AttentionProblem& problem, std::shared_ptr<Call> call,
                               absl::Time enqueued, int64_t stage_us) {
  const absl::Time started = absl::Now();
  // Deadline first: gRPC also reports a call whose deadline passed as cancelled, and it is the
  // deadline the client should hear about (and the metrics count).
  if (started >= call->deadline) {
    call->done(absl::DeadlineExceededError(
        absl::StrCat("deadline expired after ", absl::ToInt64Microseconds(started - enqueued),
                     " us in the queue; not run")));
    return;
  }
  if (call->cancelled && call->cancelled()) {
    call->done(absl::CancelledError("cancelled by the client"));
    return;
  }

  v1::AttentionResponse* response = call->response;
  const auto dtype = static_cast<v1::DType>(problem.dtype);
  v1::Tensor* out = response->mutable_out();
  SetTensorHeader(out, dtype, {problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim});
  if (problem.return_lse) {
    SetTensorHeader(response->mutable_lse(), v1::FLOAT32,
                    {problem.batch, problem.heads_q, problem.seqlen_q});
  }
  JobOutput output;
  output.deadline = call->deadline;
  output.inject_device_fault = call->inject_device_fault;
  if (call->io != nullptr) {
    output.out = call->io->o();
    output.lse = call->io->lse();
    output.pinned = call->io->pinned();
    output.outputs_in_one_buffer = true;
    if (!call->io->has_inputs()) {
      for (int i = 0; i < 3; ++i) output.input_pieces[i] = call->input_pieces[i];
    }
  } else {
    out->mutable_data()->resize(size_t(problem.out_bytes()));
    output.out = out->mutable_data()->data();
    if (problem.return_lse) {
      std::string* lse = response->mutable_lse()->mutable_data();
      lse->resize(size_t(problem.lse_elements()) * sizeof(float));
      output.lse = reinterpret_cast<float*>(lse->data());
    }
  }
  // The call (request, response, io) stays alive until its done() runs, so the backend may keep
  // writing into `output` after this worker returns.
  backend_->RunAsync(problem, output,
                     [this, call, problem, enqueued, started, stage_us](JobResult result) {
                       result.timing.stage_us += stage_us;
                       call->done(Finish(problem, *call, enqueued, started, std::move(result)));
                     });
}

absl::Status AttentionRuntime::Finish(const AttentionProblem& problem, const Call& call,
                                      absl::Time enqueued, absl::Time started, JobResult result) {
  v1::AttentionResponse* response = call.response;
  // A client that went away while its job ran gets CANCELLED (counted and logged as such),
  // not an OK nobody reads.
  if (result.status.ok() && call.cancelled && call.cancelled()) {
    result.status = absl::CancelledError("cancelled by the client while computing");
  }
  if (!result.status.ok()) {
    response->clear_out();
    response->clear_lse();
    return result.status;
  }
  const PhaseTiming& phases = result.timing;
  const std::string& kernel = result.kernel;
  v1::Timing* timing = response->mutable_timing();
  timing->set_queue_us(absl::ToInt64Microseconds(started - enqueued));
  timing->set_stage_us(phases.stage_us);
  timing->set_h2d_us(phases.h2d_us);
  timing->set_compute_us(phases.compute_us);
  timing->set_d2h_us(phases.d2h_us);
  timing->set_total_us(absl::ToInt64Microseconds(absl::Now() - call.received));
  response->set_kernel(kernel);
  response->set_request_id(call.request->request_id());
  if (metrics_ != nullptr) {
    metrics_->RecordPhase(Phase::kQueue, timing->queue_us() * 1e-6);
    if (timing->h2d_us() > 0 || timing->d2h_us() > 0) {
      metrics_->RecordPhase(Phase::kH2D, timing->h2d_us() * 1e-6);
      metrics_->RecordPhase(Phase::kD2H, timing->d2h_us() * 1e-6);
    }
    metrics_->RecordPhase(Phase::kCompute, phases.compute_us * 1e-6);
    if (phases.compute_us > 0) {
      kernels::AttentionParams params = problem.params();
      metrics_->ObserveKernel(kernel,
                              kernels::attention_flops(params) / (phases.compute_us * 1e-6) / 1e12);
    }
  }
  return absl::OkStatus();
}

}  // namespace flashserve
