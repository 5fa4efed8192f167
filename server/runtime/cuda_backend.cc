#include "runtime/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autotune/kernel_choice.h"
#include "common/short_sleep_poll.h"
#include "flashserve/kernels/cuda_attention.h"
#include "memory/io_buffers.h"
#include "runtime/copy_pipeline.h"
#include "runtime/cuda_kv_store.h"
#include "runtime/cuda_transfer.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// Errors after which the CUDA context is unusable until the process restarts.
bool IsSticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorUnknown:
    case cudaErrorDevicesUnavailable:
    case cudaErrorLaunchTimeout:
      return true;
    default:
      return false;
  }
}

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

// Page-locked host memory, portable: usable by every device's copies, not only the current one.
class CudaHostAllocator final : public HostAllocator {
 public:
  void* Allocate(size_t bytes) override {
    void* pointer = nullptr;
    if (cudaHostAlloc(&pointer, bytes, cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return pointer;
  }
  void Free(void* pointer) override { cudaFreeHost(pointer); }
};

}  // namespace

// One request between launch and completion. Byte layout of both the device buffer and the
// request buffers: IoLayout (q | k | v | o | lse, each part 256-byte aligned).
struct CudaBackend::Job {
  BackendJob spec;
  IoLayout layout;  // of the device buffer
  JobDone done;
  kernels::cuda::KernelConfig config;
  int chunks = 1;  // > 1: copies and kernel pipelined over head chunks (runtime/copy_pipeline.h)
  cudaError_t launch_error = cudaSuccess;  // the first error while queueing the work
  const char* failed_step = "";

  // Keeps the first failure of a queued step; true while none has failed.
  bool Step(cudaError_t result, const char* what) {
    if (result != cudaSuccess && launch_error == cudaSuccess) {
      launch_error = result;
      failed_step = what;
    }
    return launch_error == cudaSuccess;
  }
};

// A stream with its timing events and the thread that completes its jobs, one job at a time.
struct CudaBackend::Slot {
  Device* device = nullptr;
  cudaStream_t stream = nullptr;
  // start, after H2D, after kernel, after D2H (polled by the completion thread), and a copy of the
  // last with cudaEventBlockingSync and no timing, which the completion thread sleeps on once
  // polling has taken longer than completion_spin_us.
  cudaEvent_t events[5] = {};
  std::mutex mu;
  std::condition_variable cv;
  std::unique_ptr<Job> job;  // guarded by mu: handed over by the launching worker
  bool exiting = false;      // guarded by mu
  std::thread completer;
  BatchCopy batch;  // used by the launching thread while it holds the slot
  std::unique_ptr<CopyPipeline> pipeline;  // with --copy_pipeline_chunks > 1 only
};

struct CudaBackend::Device {
  int index = 0;
  int sm_count = 0;
  bool tuned = false;  // same model as the first device: uses the tuning cache (KernelChooser)
  std::vector<std::unique_ptr<Slot>> slots;
  // Guarded by CudaBackend::mu_.
  std::vector<Slot*> free_slots;
  int64_t outstanding_bytes = 0;  // device bytes of the jobs on this device now
  int in_flight = 0;
  uint64_t last_chosen = 0;  // AcquireSlot's count when it last picked this device
};

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::UnavailableError(e == cudaSuccess ? "no CUDA device visible"
                                                   : absl::StrCat("CUDA: ", cudaGetErrorString(e)));
  }
  // Ranges were checked by CudaBackendOptions::Check (runtime/backend_options.h).
  std::vector<int> wanted = options.devices;
  if (wanted.empty()) {
    for (int i = 0; i < count; ++i) wanted.push_back(i);
  }
  auto backend = std::unique_ptr<CudaBackend>(new CudaBackend());
  backend->capabilities_.name = "cuda";
  backend->capabilities_.dtypes = kernels::cuda::supported_dtypes();
  backend->capabilities_.head_dims = kernels::cuda::supported_head_dims();
  backend->capabilities_.max_head_dim =
      backend->capabilities_.head_dims.empty()
          ? 0
          : *std::max_element(backend->capabilities_.head_dims.begin(),
                              backend->capabilities_.head_dims.end());
  for (int index : wanted) {
    if (index >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: device ", index, " does not exist (", count, " visible)"));
    }
    if (absl::Status s = backend->AddDevice(index, options); !s.ok()) return s;
  }
  if (backend->devices_.empty()) {
    return absl::UnavailableError("no CUDA device with compute capability >= 8.0");
  }
  std::vector<int> indices;
  for (const auto& device : backend->devices_) indices.push_back(device->index);
  backend->shm_access_ = std::make_unique<CudaShmAccess>(std::move(indices));
  backend->max_device_bytes_per_request_ = options.max_device_bytes_per_request;
  backend->completion_spin_us_ = options.completion_spin_us;
  backend->copy_pipeline_chunks_ = options.copy_pipeline_chunks;
  if (options.pinned_pool_bytes > 0) {
    PinnedPoolOptions pinned_options;
    pinned_options.capacity_bytes = size_t(options.pinned_pool_bytes);
    absl::StatusOr<std::unique_ptr<PinnedPool>> pinned =
        PinnedPool::Create(pinned_options, std::make_unique<CudaHostAllocator>());
    if (!pinned.ok()) return pinned.status();
    backend->pinned_ = std::move(*pinned);
  }
  if (absl::Status s = backend->StartKernelChoice(options); !s.ok()) return s;
  for (auto& device : backend->devices_) {
    for (auto& slot : device->slots) {
      Slot* raw = slot.get();
      CudaBackend* self = backend.get();
      slot->completer = std::thread([self, raw] { self->CompletionLoop(raw); });
    }
  }
  return backend;
}

absl::StatusOr<std::unique_ptr<CudaBackend::Slot>> CudaBackend::MakeSlot(
    Device* device, const CudaBackendOptions& options) {
  auto slot = std::make_unique<Slot>();
  slot->device = device;
  cudaError_t e = cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA stream: ", cudaGetErrorString(e)));
  }
  for (int j = 0; j < 5; ++j) {
    // The last is the blocking twin of the fourth (see Slot::events).
    const unsigned flags =
        j == 4 ? cudaEventBlockingSync | cudaEventDisableTiming : cudaEventDefault;
    e = cudaEventCreateWithFlags(&slot->events[j], flags);
    if (e != cudaSuccess) {
      return absl::UnavailableError(absl::StrCat("CUDA event: ", cudaGetErrorString(e)));
    }
  }
  if (options.copy_pipeline_chunks > 1) {  // at startup, not on the first large request
    absl::StatusOr<std::unique_ptr<CopyPipeline>> pipeline = CopyPipeline::Create();
    if (!pipeline.ok()) return pipeline.status();
    slot->pipeline = *std::move(pipeline);
  }
  return slot;
}

absl::Status CudaBackend::AddDevice(int index, const CudaBackendOptions& options) {
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, index); e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA device ", index, ": ", cudaGetErrorString(e)));
  }
  if (prop.major < 8) {
    spdlog::warn("CUDA device {} ({}) has compute capability {}.{} < 8.0: not used", index,
                 prop.name, prop.major, prop.minor);
    return absl::OkStatus();
  }
  auto device = std::make_unique<Device>();
  device->index = index;
  device->sm_count = prop.multiProcessorCount;
  cudaSetDevice(index);
  for (int i = 0; i < options.streams_per_device; ++i) {
    absl::StatusOr<std::unique_ptr<Slot>> slot = MakeSlot(device.get(), options);
    if (!slot.ok()) return slot.status();
    device->free_slots.push_back(slot->get());
    device->slots.push_back(*std::move(slot));
  }
  // Device memory: the stream-ordered allocator (cudaMallocAsync on the device's default pool)
  // rather than an arena of our own. Allocation and free are ordered on the job's stream, so a
  // buffer is reused by the next job as soon as the stream reaches the free, without a host sync;
  // the pool handles any mix of sizes without the fragmentation and size classes an arena needs,
  // and its counters feed device_memory_pool_bytes. The release threshold keeps up to that many
  // freed bytes mapped (the default 0 would unmap and re-map memory around every request);
  // an allocation that cannot be had fails with cudaErrorMemoryAllocation -> RESOURCE_EXHAUSTED.
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, index) == cudaSuccess) {
    uint64_t threshold = options.device_pool_release_threshold_bytes;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  }
  DeviceDescription description;
  description.index = index;
  description.name = prop.name;
  description.cc_major = prop.major;
  description.cc_minor = prop.minor;
  description.total_memory_bytes = int64_t(prop.totalGlobalMem);
  capabilities_.devices.push_back(description);
  devices_.push_back(std::move(device));
  return absl::OkStatus();
}

absl::Status CudaBackend::StartKernelChoice(const CudaBackendOptions& options) {
  KernelChoiceOptions choice;
  choice.autotune = options.autotune;
  choice.tune_cache_path = options.tune_cache_path;
  choice.startup_grid = options.startup_grid;
  choice.on_event = options.on_autotune_event;
  const Device& first = *devices_.front();
  absl::StatusOr<std::unique_ptr<KernelChooser>> chooser =
      KernelChooser::Create(choice, first.index, first.sm_count);
  if (!chooser.ok()) return chooser.status();
  chooser_ = std::move(*chooser);
  for (size_t i = 0; i < devices_.size(); ++i) {
    const DeviceDescription& d = capabilities_.devices[i];
    devices_[i]->tuned = chooser_->Covers(d.name, d.cc_major, d.cc_minor);
  }
  return absl::OkStatus();
}

CudaBackend::~CudaBackend() {
  chooser_.reset();  // joins the tuning thread before CUDA goes away
  // Completion threads finish the job they hold (the scheduler has drained before this).
  for (auto& device : devices_) {
    for (auto& slot : device->slots) {
      {
        std::lock_guard<std::mutex> lock(slot->mu);
        slot->exiting = true;
      }
      slot->cv.notify_all();
      if (slot->completer.joinable()) slot->completer.join();
    }
  }
  for (auto& device : devices_) {
    cudaSetDevice(device->index);
    for (auto& slot : device->slots) {
      for (cudaEvent_t event : slot->events) {
        if (event != nullptr) cudaEventDestroy(event);
      }
      slot->pipeline.reset();  // its streams and events, while the device is current
      if (slot->stream != nullptr) cudaStreamDestroy(slot->stream);
    }
  }
  pinned_.reset();  // cudaFreeHost of the cached staging buffers, while CUDA is still up
}

bool CudaBackend::DevicePoolBytes(int device, int64_t* used, int64_t* reserved) const {
  cudaMemPool_t pool;
  if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  uint64_t used_bytes = 0, reserved_bytes = 0;
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used_bytes) != cudaSuccess ||
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved_bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  *used = int64_t(used_bytes);
  *reserved = int64_t(reserved_bytes);
  return true;
}

bool CudaBackend::PinnedPoolBytes(int64_t* used, int64_t* reserved) const {
  if (!pinned_) return false;
  const PinnedPoolStats stats = pinned_->stats();
  *used = stats.used_bytes;
  *reserved = stats.reserved_bytes;
  return true;
}

int CudaBackend::recommended_concurrency() const {
  int n = 0;
  for (const auto& device : devices_) n += int(device->slots.size());
  return n;
}

bool CudaBackend::can_launch_now() {
  if (!healthy()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& device : devices_) {
    if (!device->free_slots.empty()) return true;
  }
  return false;
}

// Load balancing: the device with a free slot and the fewest outstanding device bytes (a proxy
// for the work queued on it; ties go to fewer jobs, then to the device picked least recently, so
// requests that never overlap still take turns instead of all landing on device 0).
CudaBackend::Slot* CudaBackend::AcquireSlot(int64_t device_bytes) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!healthy()) return nullptr;
    Device* best = nullptr;
    for (auto& device : devices_) {
      if (device->free_slots.empty()) continue;
      if (best == nullptr || device->outstanding_bytes < best->outstanding_bytes ||
          (device->outstanding_bytes == best->outstanding_bytes &&
           (device->in_flight < best->in_flight ||
            (device->in_flight == best->in_flight &&
             device->last_chosen < best->last_chosen)))) {
        best = device.get();
      }
    }
    if (best != nullptr) {
      Slot* slot = best->free_slots.back();
      best->free_slots.pop_back();
      best->outstanding_bytes += device_bytes;
      best->in_flight++;
      best->last_chosen = ++choices_;
      return slot;
    }
    // Every slot is busy: wait for a completion (or a fault, which releases slots too). Bounded
    // by the scheduler: at most recommended_concurrency() waiters.
    slot_cv_.wait(lock);
  }
}

void CudaBackend::ReleaseSlot(Slot* slot, int64_t device_bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Device* device = slot->device;
    device->free_slots.push_back(slot);
    device->outstanding_bytes -= device_bytes;
    device->in_flight--;
  }
  slot_cv_.notify_one();
}

absl::Status CudaBackend::DeviceError(Device* device, cudaError_t e, const char* what) {
  if (IsSticky(e)) {
    // A sticky error leaves CUDA unusable in the whole process, not only on this device: on two
    // H200s, after a fault on device 0 every call on device 1 failed too, from every thread
    // (bench/results/service-h100-h200x2-2026-11-22.md). So nothing runs any more; readiness
    // turns false so that the orchestrator replaces the process.
    if (healthy_.exchange(false)) {
      spdlog::critical("CUDA device {} faulted in {} ({}): CUDA is unusable in this process, on "
                       "every device; reporting not ready, further requests get UNAVAILABLE",
                       device->index, what, cudaGetErrorString(e));
    }
    slot_cv_.notify_all();  // waiters re-check and give up
    return absl::InternalError(absl::StrCat("CUDA fault in ", what, ": ", cudaGetErrorString(e)));
  }
  cudaGetLastError();  // clear a non-sticky error so the next job on this thread starts clean
  return absl::InternalError(absl::StrCat("CUDA ", what, ": ", cudaGetErrorString(e)));
}

absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CudaBackend::CreateKvStore(
    int64_t bytes, int launches_in_flight) {
  Device* device = devices_.front().get();
  // Split counts from the autotuner's decode classes where tuned (a miss queues the class for
  // background tuning and answers with the heuristic); the sequences die before the backend.
  auto choose_splits = [this, device](const kernels::cuda::DecodeParams& p) {
    return DecodeSplitsFor(chooser_.get(), p, device->sm_count, device->tuned);
  };
  absl::StatusOr<std::unique_ptr<CudaKvStore>> store = CudaKvStore::Create(
      bytes, device->index, launches_in_flight, std::move(choose_splits),
      [this, device](cudaError_t e, const char* what) { return DeviceError(device, e, what); });
  if (!store.ok()) return store.status();
  return std::unique_ptr<kvcache::KvStore>(std::move(*store));
}

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
    return fail(absl::UnavailableError("a CUDA device faulted earlier; server not ready"));
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
    return fail(absl::UnavailableError("a CUDA device faulted earlier; server not ready"));
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
  if (job.spec.inject_device_fault || slot->pipeline == nullptr) return 1;
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
}

void CudaBackend::QueueInOrder(Slot* slot, Job* job, char* base,
                               const kernels::AttentionParams& params) {
  cudaStream_t stream = slot->stream;
  const JobTensors& tensors = job->spec.tensors;
  const int index = slot->device->index;
  job->Step(QueueInputCopies(tensors, job->layout, base, index, stream, &slot->batch),
            "H2D copy");
  job->Step(cudaEventRecord(slot->events[1], stream), "cudaEventRecord");
  if (job->spec.inject_device_fault && job->launch_error == cudaSuccess) {
    job->Step(kernels::cuda::launch_fault_for_testing(stream), "kernel");
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
