#include "runtime/cpu_backend.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/cpu_kv_store.h"

namespace flashserve {
namespace {

// Why a job stopped early; its partial output is never sent (the runtime clears it on an error).
absl::Status StoppedStatus(const BackendJob& job, int64_t computed_us) {
  if (absl::Now() >= job.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while computing; stopped after ", computed_us, " us"));
  }
  return absl::CancelledError(absl::StrCat("stopped after ", computed_us, " us"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const CpuBackendOptions& options) {
  if (absl::Status s = options.Check(); !s.ok()) return s;
  auto backend = std::unique_ptr<CpuBackend>(new CpuBackend(options.num_threads));
  if (options.buffer_pool_bytes > 0) {
    PinnedPoolOptions pool_options;
    pool_options.capacity_bytes = size_t(options.buffer_pool_bytes);
    pool_options.page_locked = false;
    // The CPU backend runs one job at a time (a few more are parsed or answered meanwhile).
    pool_options.max_cached_per_class = 2;
    absl::StatusOr<std::unique_ptr<PinnedPool>> pool =
        PinnedPool::Create(pool_options, std::make_unique<HeapAllocator>());
    if (!pool.ok()) return pool.status();
    backend->buffers_ = std::move(*pool);
  }
  return backend;
}

// The CPU store computes on the caller's thread: there is no device queue to keep launches in.
absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CpuBackend::CreateKvStore(
    int64_t bytes, int /*launches_in_flight*/) {
  absl::StatusOr<std::unique_ptr<CpuKvStore>> store = CpuKvStore::Create(bytes, pool_.get());
  if (!store.ok()) return store.status();
  return std::unique_ptr<kvcache::KvStore>(std::move(*store));
}

CpuBackend::CpuBackend(int num_threads)
    : pool_(std::make_unique<kernels::cpu::ThreadPool>(num_threads)) {
  capabilities_.name = "cpu";
  capabilities_.dtypes = {kernels::DType::kFloat16, kernels::DType::kBFloat16,
                          kernels::DType::kFloat32};
  capabilities_.max_head_dim = kernels::cpu::kMaxHeadDim;
}

absl::Status CpuBackend::Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) {
  if (!healthy_.load()) {
    return absl::UnavailableError(
        "server not ready: the backend faulted earlier (an injected fault, "
        "--enable_fault_injection)");
  }
  if (job.inject == InjectedFault::kDeviceHang) {
    // A launch the device never completes: nothing ends it, not the deadline, not the shutdown.
    for (;;) absl::SleepFor(absl::Hours(1));
  }
  if (job.inject == InjectedFault::kDeviceFault) {
    healthy_.store(false);
    return absl::InternalError("injected fault (--enable_fault_injection): backend unusable");
  }
  const JobTensors& t = job.tensors;
  if (!t.q.contiguous() || !t.k.contiguous() || !t.v.contiguous()) {
    return absl::InternalError("CPU backend: inputs must be contiguous (the runtime stages them)");
  }
  kernels::AttentionParams params = job.problem.params();
  params.q = t.q.data();
  params.k = t.k.data();
  params.v = t.v.data();
  params.o = t.o.data;
  params.lse = reinterpret_cast<float*>(t.lse.data);
  if (std::string why = kernels::cpu::supported(params); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  const absl::Time start = absl::Now();
  // Work grows as seqlen_q x seqlen_k: once nobody waits for the answer the threads must go to
  // the next request, not finish this one (tens of seconds for a large one).
  kernels::cpu::StopSignal stop(
      [&job] { return absl::Now() >= job.deadline || (job.cancelled && job.cancelled()); });
  const bool finished = kernels::cpu::attention_forward(params, pool_.get(), &stop);
  timing->compute_us = absl::ToInt64Microseconds(absl::Now() - start);
  if (!finished) return StoppedStatus(job, timing->compute_us);
  *kernel = "cpu_tiled_online_softmax";
  return absl::OkStatus();
}

}  // namespace flashserve
