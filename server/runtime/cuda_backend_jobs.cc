// CudaBackend: one attention request from launch to completion -- its device buffer, the copies
// and kernel queued on a slot's stream (in order or pipelined over head chunks), and the slot's
// completion thread that answers it. Devices, slots and the KV store: cuda_backend.cc.
#include <cuda_runtime_api.h>

#include <chrono>
#include <future>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/short_sleep_poll.h"
#include "flashserve/kernels/cuda_attention.h"
#include "runtime/cuda_backend_internal.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// InjectedFault::kDeviceHang: far past any shutdown bound, yet the GPU comes back by itself.
constexpr int kInjectedHangSeconds = 600;

// A deliberately pessimistic guess of a job's device time: copies at 10 GB/s (small pinned copies
// reach less than the link's peak), attention at 100 TFLOP/s.
double PredictedDeviceUs(const AttentionProblem& problem, const IoLayout& layout) {
  const double bytes = double(layout.total);
  return bytes / 10e9 * 1e6 + kernels::attention_flops(problem.params()) / 100e12 * 1e6;
}

int64_t ElapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  return cudaEventElapsedTime(&ms, a, b) == cudaSuccess ? int64_t(ms * 1000.f) : 0;
}

}  // namespace

absl::Status CudaBackend::Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) {
  std::promise<JobResult> promise;
  std::future<JobResult> future = promise.get_future();
  RunAsync(job, [&promise](JobResult result) { promise.set_value(std::move(result)); });
  JobResult result = future.get();
  *timing = result.timing;
  *kernel = std::move(result.kernel);
  return result.status;
}

bool CudaBackend::ReadsDirectly(const TensorBytes& tensor) const {
  // Page-locked memory is DMA'd as it lies, in any number of pieces. Pageable memory could be
  // copied too (the driver stages it), but at ~2.6x less bandwidth (21 vs 55 GB/s on an H200):
  // the runtime stages it into the pinned pool instead, and only a full pool leaves it pageable.
  // Device memory (a client's CUDA region) is read in place, or peer-copied from another GPU.
  return tensor.kind == MemoryKind::kPageLocked || tensor.kind == MemoryKind::kDevice;
}

bool CudaBackend::WritesDirectly(MemoryKind kind) const {
  return kind == MemoryKind::kPageLocked || kind == MemoryKind::kDevice;
}

// Tensors in a client's CUDA region on the job's device: the kernel reads and writes them where
// they are (runtime/cuda_transfer.h then copies nothing for them).
static void PointAtDeviceTensors(const JobTensors& t, int device_index,
                          kernels::AttentionParams* params) {
  if (OnDevice(t.q, device_index)) params->q = t.q.data();
  if (OnDevice(t.k, device_index)) params->k = t.k.data();
  if (OnDevice(t.v, device_index)) params->v = t.v.data();
  if (OnDevice(t.o, device_index)) params->o = t.o.data;
  if (params->lse != nullptr && OnDevice(t.lse, device_index)) {
    params->lse = reinterpret_cast<float*>(t.lse.data);
  }
}

// Every tensor of the job in a client's CUDA region on `device_index`: the kernel reads and writes
// them all where they are, so the job needs no device buffer of its own.
static bool AllOnDevice(const JobTensors& t, bool lse_wanted, int device_index) {
  return OnDevice(t.q, device_index) && OnDevice(t.k, device_index) &&
         OnDevice(t.v, device_index) && OnDevice(t.o, device_index) &&
         (!lse_wanted || OnDevice(t.lse, device_index));
}

void CudaBackend::RunAsync(BackendJob spec, JobDone done) {
  auto fail = [&done](absl::Status status) {
    JobResult result;
    result.status = std::move(status);
    done(std::move(result));
  };
  if (!healthy()) {
    return fail(NotReady());
  }
  auto job = std::make_unique<Job>();
  job->spec = std::move(spec);
  job->layout = IoLayout::For(job->spec.problem);
  const int64_t device_bytes = int64_t(job->layout.total);
  if (max_device_bytes_per_request_ > 0 && device_bytes > max_device_bytes_per_request_) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("request needs ", device_bytes, " bytes of device memory, over "
                     "--max_device_bytes_per_request=",
                     max_device_bytes_per_request_)));
  }
  Slot* slot = AcquireSlot(device_bytes);
  if (slot == nullptr) {
    return fail(NotReady());
  }
  if (absl::Now() >= job->spec.deadline) {
    // It waited for a slot (every stream busy) past its deadline: not worth the device time.
    ReleaseSlot(slot, device_bytes);
    return fail(absl::DeadlineExceededError("deadline expired waiting for a GPU stream; not run"));
  }
  cudaSetDevice(slot->device->index);
  char* base = nullptr;
  kernels::AttentionParams params;
  if (absl::Status s = PrepareDeviceBuffer(slot, *job, &base, &params); !s.ok()) {
    ReleaseSlot(slot, device_bytes);
    return fail(std::move(s));
  }
  // Only now: every early return above answers through `fail`, which needs `done`.
  job->done = std::move(done);
  job->chunks = PipelineChunksFor(slot, *job, base, params);
  // Each chunk is a launch of its own: its configuration is chosen for a chunk's shape.
  job->config = chooser_->Choose(job->chunks > 1 ? ChunkParams(params, job->chunks, 0) : params,
                                 slot->device->sm_count, slot->device->tuned);
  QueueWork(slot, job.get(), base, params);
  // A job expected to finish within the polling window is completed right here: handing it to the
  // slot's completion thread would add that thread's wake-up (tens of microseconds on a loaded or
  // virtualized host) to a request that takes about as long on the GPU.
  if (completion_spin_us_ > 0 &&
      PredictedDeviceUs(job->spec.problem, job->layout) * 2 <= completion_spin_us_) {
    Complete(slot, std::move(job));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->job = std::move(job);
  }
  slot->cv.notify_one();
}

absl::Status CudaBackend::PrepareDeviceBuffer(Slot* slot, const Job& job, char** base,
                                              kernels::AttentionParams* params) {
  Device* device = slot->device;
  const IoLayout& layout = job.layout;
  const bool lse_wanted = job.spec.problem.return_lse;
  *params = job.spec.problem.params();
  *base = nullptr;
  if (!AllOnDevice(job.spec.tensors, lse_wanted, device->index)) {
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(base), layout.total, slot->stream);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU ", device->index, " out of memory for ", layout.total, " bytes"));
    }
    if (e != cudaSuccess) return DeviceError(device, e, "cudaMallocAsync");
    params->q = *base;
    params->k = *base + layout.k_offset;
    params->v = *base + layout.v_offset;
    params->o = *base + layout.o_offset;
    params->lse = lse_wanted ? reinterpret_cast<float*>(*base + layout.lse_offset) : nullptr;
  } else {
    params->lse = lse_wanted ? reinterpret_cast<float*>(job.spec.tensors.lse.data) : nullptr;
  }
  PointAtDeviceTensors(job.spec.tensors, device->index, params);
  // The request was validated at the edge (dtype, head_dim, sizes); this is the kernels' own
  // word on what is left (grid limits), with the real device pointers.
  if (std::string why = kernels::cuda::supported(*params); !why.empty()) {
    if (*base != nullptr) cudaFreeAsync(*base, slot->stream);
    return absl::InvalidArgumentError(why);
  }
  return absl::OkStatus();
}

int CudaBackend::PipelineChunksFor(Slot* slot, const Job& job, const char* base,
                                   const kernels::AttentionParams& params) {
  if (job.spec.inject != InjectedFault::kNone || slot->pipeline == nullptr) return 1;
  const int chunks = PipelineChunks(params, job.spec.tensors, job.layout, base != nullptr,
                                    copy_pipeline_chunks_);
  if (chunks == 1) return 1;  // most jobs: decided without the lock
  // Only a job alone on its device: with others in flight the copy engines are busy anyway, and
  // the chunks' narrower 2D copies cost throughput (H100, system regions, c=4/16: up to -11%).
  std::lock_guard<std::mutex> lock(mu_);
  return slot->device->in_flight > 1 ? 1 : chunks;
}

void CudaBackend::QueueWork(Slot* slot, Job* job, char* base,
                            const kernels::AttentionParams& params) {
  // Everything is queued; the first failure is kept and reported by the completion thread, which
  // waits for whatever was queued before it.
  cudaStream_t stream = slot->stream;
  job->Step(cudaEventRecord(slot->events[0], stream), "cudaEventRecord");
  if (job->chunks > 1) {
    QueuePipelined(slot, job, base, params);
  } else {
    QueueInOrder(slot, job, base, params);
  }
  // Recorded even after a failure: the completion thread then waits for what was queued (the
  // H2D copies still read the request's memory) before the job's buffers are released.
  job->Step(cudaEventRecord(slot->events[3], stream), "cudaEventRecord");
  job->Step(cudaEventRecord(slot->events[4], stream), "cudaEventRecord");
  if (base != nullptr) cudaFreeAsync(base, stream);  // null: every tensor in a client region
  // A refused call is also this thread's last error: cleared here, where it happened (the thread
  // that reports it may be another), or the next launch from this thread reads it as its own.
  if (job->launch_error != cudaSuccess) cudaGetLastError();
}

void CudaBackend::QueueInOrder(Slot* slot, Job* job, char* base,
                               const kernels::AttentionParams& params) {
  cudaStream_t stream = slot->stream;
  const JobTensors& tensors = job->spec.tensors;
  const int index = slot->device->index;
  job->Step(QueueInputCopies(tensors, job->layout, base, index, stream, &slot->batch),
            "H2D copy");
  job->Step(cudaEventRecord(slot->events[1], stream), "cudaEventRecord");
  if (job->spec.inject == InjectedFault::kDeviceFault && job->launch_error == cudaSuccess) {
    job->Step(kernels::cuda::launch_fault_for_testing(stream), "kernel");
  } else if (job->spec.inject == InjectedFault::kDeviceHang && job->launch_error == cudaSuccess) {
    job->Step(kernels::cuda::launch_hang_for_testing(stream, kInjectedHangSeconds), "kernel");
  } else if (job->spec.inject == InjectedFault::kLaunchError && job->launch_error == cudaSuccess) {
    job->Step(cudaMemcpyAsync(nullptr, nullptr, 1, cudaMemcpyDeviceToDevice, stream), "kernel");
  } else if (job->launch_error == cudaSuccess &&
             job->Step(kernels::cuda::run(params, job->config, stream), "kernel")) {
    job->Step(cudaEventRecord(slot->events[2], stream), "cudaEventRecord");
    job->Step(QueueOutputCopies(tensors, job->layout, base, index, stream), "D2H copy");
  }
}

void CudaBackend::QueuePipelined(Slot* slot, Job* job, char* base,
                                 const kernels::AttentionParams& params) {
  PipelineWork work;
  work.tensors = &job->spec.tensors;
  work.layout = &job->layout;
  work.base = base;
  work.params = params;
  work.chunks = job->chunks;
  const kernels::cuda::KernelConfig config = job->config;
  work.launch = [config](const kernels::AttentionParams& p, cudaStream_t s) {
    return kernels::cuda::run(p, config, s);
  };
  const char* what = "";
  // events[1]: the last input copied; events[2]: the last chunk's kernel done (on its stream).
  job->Step(slot->pipeline->Queue(work, slot->stream, slot->events[1], slot->events[2], &what),
            what);
}

void CudaBackend::CompletionLoop(Slot* slot) {
  cudaSetDevice(slot->device->index);
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(slot->mu);
      slot->cv.wait(lock, [slot] { return slot->exiting || slot->job != nullptr; });
      if (slot->job == nullptr) return;  // exiting, nothing left
      job = std::move(slot->job);
    }
    Complete(slot, std::move(job));
  }
}

void CudaBackend::Complete(Slot* slot, std::unique_ptr<Job> job) {
  Device* device = slot->device;
  JobResult result;
  // Poll first (a small job is done within microseconds of its launch; a blocking wait would add
  // its wake-up latency), then poll with short sleeps, then sleep on the blocking-sync twin of
  // the same point in the stream (--completion_spin_us=0: straight to the blocking wait).
  cudaError_t e = cudaEventQuery(slot->events[3]);
  if (e == cudaErrorNotReady && completion_spin_us_ > 0) {
    const auto spin_end =
        std::chrono::steady_clock::now() + std::chrono::microseconds(completion_spin_us_);
    do {
      e = cudaEventQuery(slot->events[3]);
    } while (e == cudaErrorNotReady && std::chrono::steady_clock::now() < spin_end);
  }
  if (e == cudaErrorNotReady && completion_spin_us_ > 0) {
    PollWithShortSleeps([&] { return (e = cudaEventQuery(slot->events[3])) != cudaErrorNotReady; });
  }
  if (e == cudaErrorNotReady) e = cudaEventSynchronize(slot->events[4]);
  const char* what = "stream work";
  if (job->launch_error != cudaSuccess) {
    e = job->launch_error;
    what = job->failed_step;
    // Wait for what did get queued before the job's buffers go back to their owners.
    cudaStreamSynchronize(slot->stream);
  }
  if (e == cudaSuccess) {
    result.timing.h2d_us = ElapsedUs(slot->events[0], slot->events[1]);
    result.timing.compute_us = ElapsedUs(slot->events[1], slot->events[2]);
    result.timing.d2h_us = ElapsedUs(slot->events[2], slot->events[3]);
    const AttentionProblem& problem = job->spec.problem;
    // The family that ran leads the name (the sm90 family's configuration names carry it too).
    const bool sm90 = job->config.family == kernels::cuda::KernelFamily::kSm90;
    result.kernel = absl::StrCat(sm90 ? "sm90_fwd_" : "sm80_fwd_",
                                 std::string(kernels::dtype_name(problem.dtype)), "_d",
                                 problem.head_dim, problem.causal ? "_causal_" : "_",
                                 job->config.name(),
                                 job->chunks > 1 ? absl::StrCat("_chunks", job->chunks) : "");
  } else {
    result.status = DeviceError(device, e, what);
  }
  JobDone done = std::move(job->done);
  const int64_t device_bytes = int64_t(job->layout.total);
  job.reset();
  ReleaseSlot(slot, device_bytes);
  done(std::move(result));
}

}  // namespace flashserve
