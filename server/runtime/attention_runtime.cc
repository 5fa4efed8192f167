#include "runtime/attention_runtime.h"

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
  accepting_.store(false);
  scheduler_->StopAccepting();
}

void AttentionRuntime::Submit(Call call) {
  if (!accepting_.load()) {
    call.done(absl::UnavailableError("server is shutting down"));
    return;
  }
  absl::StatusOr<AttentionProblem> problem = ValidateAttentionRequest(*call.request, limits_);
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
  call.done = [this, bytes, done = std::move(call.done)](const absl::Status& status) {
    inflight_bytes_.fetch_sub(bytes);
    done(status);
  };
  const absl::Time enqueued = absl::Now();
  // The job owns the call; if Submit refuses it, the job is destroyed unrun and we answer here.
  auto shared_call = std::make_shared<Call>(std::move(call));
  absl::Status queued = scheduler_->Submit([this, shared_call, problem = *problem, enqueued] {
    shared_call->done(Execute(problem, *shared_call, enqueued));
  });
  if (!queued.ok()) shared_call->done(queued);
}

absl::Status AttentionRuntime::Execute(const AttentionProblem& problem, const Call& call,
                                       absl::Time enqueued) {
  const absl::Time started = absl::Now();
  if (call.cancelled && call.cancelled()) return absl::CancelledError("cancelled by the client");
  if (started >= call.deadline) {
    return absl::DeadlineExceededError(absl::StrCat("deadline expired after ",
                                                    absl::ToInt64Microseconds(started - enqueued),
                                                    " us in the queue; not run"));
  }

  v1::AttentionResponse* response = call.response;
  const auto dtype = static_cast<v1::DType>(problem.dtype);
  v1::Tensor* out = response->mutable_out();
  SetTensorHeader(out, dtype, {problem.batch, problem.seqlen_q, problem.heads_q, problem.head_dim});
  out->mutable_data()->resize(size_t(problem.out_bytes()));
  JobOutput output;
  output.out = out->mutable_data()->data();
  if (problem.return_lse) {
    v1::Tensor* lse = response->mutable_lse();
    SetTensorHeader(lse, v1::FLOAT32, {problem.batch, problem.heads_q, problem.seqlen_q});
    lse->mutable_data()->resize(size_t(problem.lse_elements()) * sizeof(float));
    output.lse = reinterpret_cast<float*>(lse->mutable_data()->data());
  }

  PhaseTiming phases;
  std::string kernel;
  absl::Status status = backend_->Run(problem, output, &phases, &kernel);
  if (!status.ok()) {
    response->clear_out();
    response->clear_lse();
    return status;
  }
  v1::Timing* timing = response->mutable_timing();
  timing->set_queue_us(absl::ToInt64Microseconds(started - enqueued));
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
