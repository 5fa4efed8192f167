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
#include "autotune/cuda_tuning.h"
#include "autotune/problem_class.h"
#include "memory/receive_arena.h"
#include "flashserve/kernels/cuda_attention.h"
#include "memory/io_buffers.h"
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

// The argument arrays of one batch copy, kept by a slot so that launches reuse their memory.
struct BatchCopy {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

// Queues the copies of q, k and v from the receive arena's page-locked blocks (gRPC reads 64 KiB
// at a time, so a 48 MiB request is ~770 pieces) to `base` + offsets: one batch call, which costs
// the host far less than one cudaMemcpyAsync per piece; piece by piece where batches are not
// supported.
cudaError_t CopyPiecesToDevice(const InputPieces* const pieces[3], char* base,
                               const std::array<size_t, 3>& offsets, cudaStream_t stream,
                               BatchCopy* batch) {
  std::vector<void*>& dsts = batch->dsts;
  std::vector<const void*>& srcs = batch->srcs;
  std::vector<size_t>& sizes = batch->sizes;
  dsts.clear();
  srcs.clear();
  sizes.clear();
  for (int i = 0; i < 3; ++i) {
    char* dest = base + offsets[size_t(i)];
    for (std::string_view piece : *pieces[i]) {
      if (piece.empty()) continue;
      dsts.push_back(dest);
      srcs.push_back(piece.data());
      sizes.push_back(piece.size());
      dest += piece.size();
    }
  }
  if (dsts.empty()) return cudaSuccess;
  cudaMemcpyAttributes attributes = {};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attribute_index = 0;
  cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), dsts.size(),
                                       &attributes, &attribute_index, 1, stream);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  cudaGetLastError();
  for (size_t i = 0; i < dsts.size(); ++i) {
    e = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

// One request between launch and completion. Byte layout of both the device buffer and the
// pinned staging buffer: IoLayout (q | k | v | o | lse, each part 256-byte aligned).
struct CudaBackend::Job {
  AttentionProblem problem;
  JobOutput output;
  JobDone done;
  int64_t device_bytes = 0;
  PinnedPool::Buffer staging;  // empty: copies straight from/to the caller's memory
  int64_t stage_us = 0;
  size_t o_offset = 0, lse_offset = 0;
  kernels::cuda::KernelConfig config;
  cudaError_t launch_error = cudaSuccess;  // the first error while queueing the work
  const char* failed_step = "";
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
};

struct CudaBackend::Device {
  int index = 0;
  int sm_count = 0;
  bool tuned = false;  // same model as the first device: uses the tuning cache
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
  if (options.streams_per_device < 1 || options.streams_per_device > 64) {
    return absl::InvalidArgumentError(absl::StrCat("--streams_per_device must be in [1, 64], got ",
                                                   options.streams_per_device));
  }
  if (options.pinned_pool_bytes < 0 || options.max_device_bytes_per_request < 0) {
    return absl::InvalidArgumentError(
        "--pinned_pool_bytes and --max_device_bytes_per_request must be >= 0");
  }
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
    cudaDeviceProp prop{};
    if ((e = cudaGetDeviceProperties(&prop, index)) != cudaSuccess) {
      return absl::UnavailableError(
          absl::StrCat("CUDA device ", index, ": ", cudaGetErrorString(e)));
    }
    if (prop.major < 8) {
      spdlog::warn("CUDA device {} ({}) has compute capability {}.{} < 8.0: not used", index,
                   prop.name, prop.major, prop.minor);
      continue;
    }
    auto device = std::make_unique<Device>();
    device->index = index;
    device->sm_count = prop.multiProcessorCount;
    cudaSetDevice(index);
    for (int i = 0; i < options.streams_per_device; ++i) {
      auto slot = std::make_unique<Slot>();
      slot->device = device.get();
      if ((e = cudaStreamCreateWithFlags(&slot->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        return absl::UnavailableError(absl::StrCat("CUDA stream: ", cudaGetErrorString(e)));
      }
      for (int j = 0; j < 5; ++j) {
        e = cudaEventCreateWithFlags(&slot->events[j],
                                     j == 4 ? cudaEventBlockingSync | cudaEventDisableTiming
                                            : cudaEventDefault);
        if (e != cudaSuccess) {
          return absl::UnavailableError(absl::StrCat("CUDA event: ", cudaGetErrorString(e)));
        }
      }
      device->free_slots.push_back(slot.get());
      device->slots.push_back(std::move(slot));
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
    backend->capabilities_.devices.push_back(description);
    backend->devices_.push_back(std::move(device));
  }
  if (backend->devices_.empty()) {
    return absl::UnavailableError("no CUDA device with compute capability >= 8.0");
  }
  backend->max_device_bytes_per_request_ = options.max_device_bytes_per_request;
  if (options.completion_spin_us < 0 || options.completion_spin_us > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--completion_spin_us must be in [0, 1000000], got ", options.completion_spin_us));
  }
  backend->completion_spin_us_ = options.completion_spin_us;
  if (options.pinned_pool_bytes > 0) {
    PinnedPoolOptions pinned_options;
    pinned_options.capacity_bytes = size_t(options.pinned_pool_bytes);
    absl::StatusOr<std::unique_ptr<PinnedPool>> pinned =
        PinnedPool::Create(pinned_options, std::make_unique<CudaHostAllocator>());
    if (!pinned.ok()) return pinned.status();
    backend->pinned_ = std::move(*pinned);
  }
  if (absl::Status s = backend->StartAutotune(options); !s.ok()) return s;
  for (auto& device : backend->devices_) {
    for (auto& slot : device->slots) {
      Slot* raw = slot.get();
      CudaBackend* self = backend.get();
      slot->completer = std::thread([self, raw] { self->CompletionLoop(raw); });
    }
  }
  return backend;
}

absl::Status CudaBackend::StartAutotune(const CudaBackendOptions& options) {
  const std::string& mode = options.autotune;
  if (mode != "off" && mode != "background" && mode != "startup") {
    return absl::InvalidArgumentError(
        absl::StrCat("--autotune must be off, background or startup, got \"", mode, "\""));
  }
  if (mode == "off" && options.tune_cache_path.empty()) return absl::OkStatus();
  Device& first = *devices_.front();
  absl::StatusOr<CudaDeviceFacts> facts = DescribeCudaDevice(first.index);
  if (!facts.ok()) return facts.status();
  tuned_identity_ = facts->identity;
  for (auto& device : devices_) {
    const DeviceDescription& d = capabilities_.devices[size_t(&device - &devices_.front())];
    device->tuned = d.name == tuned_identity_.name && d.cc_major == tuned_identity_.cc_major &&
                    d.cc_minor == tuned_identity_.cc_minor;
  }
  tune_cache_ = std::make_unique<TuneCache>(CacheHeaderFor(tuned_identity_));
  if (!options.tune_cache_path.empty()) {
    if (absl::Status s = tune_cache_->Load(options.tune_cache_path); !s.ok()) {
      spdlog::warn("autotune: ignoring the tuning cache: {}", std::string(s.message()));
    } else {
      spdlog::info("autotune: {} tuned classes loaded from {}", tune_cache_->size(),
                   options.tune_cache_path);
    }
  }
  if (mode == "off") return absl::OkStatus();

  // Tuning runs on its own stream at the lowest priority, one class at a time.
  cudaSetDevice(first.index);
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (cudaError_t e = cudaStreamCreateWithPriority(&tune_stream_, cudaStreamNonBlocking, least);
      e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA tuning stream: ", cudaGetErrorString(e)));
  }
  const int device_index = first.index;
  const int sm_count = first.sm_count;
  cudaStream_t stream = tune_stream_;
  BackgroundTuner::Options tuner_options;
  tuner_options.cache_path = options.tune_cache_path;
  tuner_ = std::make_unique<BackgroundTuner>(
      tune_cache_.get(),
      [device_index, sm_count, stream](const ProblemClass& c) {
        cudaSetDevice(device_index);
        return TuneProblemClass(c, sm_count, stream);
      },
      tuner_options, options.on_autotune_event);
  if (mode == "startup") {
    const std::vector<ProblemClass> classes = GridClasses(options.startup_grid, tuned_identity_);
    spdlog::info("autotune: tuning {} classes before reporting ready", classes.size());
    for (const ProblemClass& c : classes) tuner_->Enqueue(c);
    tuner_->WaitIdle(absl::InfiniteDuration());
    spdlog::info("autotune: startup tuning done ({} classes cached)", tune_cache_->size());
  }
  return absl::OkStatus();
}

kernels::cuda::KernelConfig CudaBackend::ChooseConfig(const kernels::AttentionParams& params,
                                                      const Device& device) {
  const kernels::cuda::KernelConfig fallback = kernels::cuda::select(params, device.sm_count);
  if (!device.tuned || !tune_cache_) return fallback;
  const ProblemClass c = ClassOf(params, tuned_identity_);
  std::optional<std::string> name;
  if (tuner_) {
    name = tuner_->Lookup(c);
  } else if (std::optional<TuneRecord> record = tune_cache_->Find(c.key())) {
    name = record->config;
  }
  if (!name) return fallback;
  std::optional<kernels::cuda::KernelConfig> tuned = kernels::cuda::KernelConfig::parse(*name);
  if (!tuned) return fallback;
  for (const auto& candidate :
       kernels::cuda::candidates(params.dtype, params.head_dim, params.causal)) {
    if (candidate == *tuned) return *tuned;
  }
  return fallback;  // a cached name this build does not have
}

CudaBackend::~CudaBackend() {
  tuner_.reset();  // joins the tuning thread before its stream goes away
  if (tune_stream_ != nullptr) cudaStreamDestroy(tune_stream_);
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

absl::Status CudaBackend::Run(const AttentionProblem& problem, const JobOutput& output,
                              PhaseTiming* timing, std::string* kernel) {
  std::promise<JobResult> promise;
  std::future<JobResult> future = promise.get_future();
  RunAsync(problem, output, [&promise](JobResult result) { promise.set_value(std::move(result)); });
  JobResult result = future.get();
  *timing = result.timing;
  *kernel = std::move(result.kernel);
  return result.status;
}

bool CudaBackend::ReadsInPlace(const InputPieces* const pieces[3]) const {
  const ReceiveArena* arena = ReceiveArena::Installed();
  if (arena == nullptr || !arena->page_locked()) return false;
  for (int i = 0; i < 3; ++i) {
    if (pieces[i] == nullptr) return false;
    for (std::string_view piece : *pieces[i]) {
      if (!arena->Contains(piece.data(), piece.size())) return false;
    }
  }
  return true;
}

void CudaBackend::RunAsync(const AttentionProblem& problem, const JobOutput& output,
                           JobDone done) {
  auto fail = [&done](absl::Status status) {
    JobResult result;
    result.status = std::move(status);
    done(std::move(result));
  };
  if (!healthy()) {
    return fail(absl::UnavailableError("a CUDA device faulted earlier; server not ready"));
  }
  kernels::AttentionParams params = problem.params();
  {
    // Shape, dtype and stride checks before taking a slot; supported() also wants non-null, aligned
    // pointers (never dereferenced), which the device buffer below satisfies by construction.
    alignas(256) static char probe[16];
    kernels::AttentionParams check = params;
    check.q = check.k = check.v = check.o = probe;
    if (std::string why = kernels::cuda::supported(check); !why.empty()) {
      return fail(absl::InvalidArgumentError(why));
    }
  }
  const IoLayout layout = IoLayout::For(problem);
  const size_t q_bytes = layout.q_bytes, kv_bytes = layout.kv_bytes, lse_bytes = layout.lse_bytes;
  const size_t k_offset = layout.k_offset, v_offset = layout.v_offset;
  const size_t o_offset = layout.o_offset, lse_offset = layout.lse_offset;
  const size_t total = layout.total;
  if (max_device_bytes_per_request_ > 0 && int64_t(total) > max_device_bytes_per_request_) {
    return fail(absl::ResourceExhaustedError(
        absl::StrCat("request needs ", total, " bytes of device memory, over "
                     "--max_device_bytes_per_request=",
                     max_device_bytes_per_request_)));
  }

  auto job = std::make_unique<Job>();
  job->problem = problem;
  job->output = output;
  job->device_bytes = int64_t(total);
  job->o_offset = o_offset;
  job->lse_offset = lse_offset;

  const char* host_q = static_cast<const char*>(problem.q);
  const char* host_k = static_cast<const char*>(problem.k);
  const char* host_v = static_cast<const char*>(problem.v);
  char* host_o = static_cast<char*>(output.out);
  char* host_lse = reinterpret_cast<char*>(output.lse);
  // Inputs not already pinned are staged in pinned memory before taking a slot: this host copy
  // overlaps the GPU work of the jobs already on the device. Without a staging buffer (pool at its
  // cap) the copies go straight from/to pageable memory: slower (the driver stages them itself),
  // but the request is still served rather than refused.
  const bool in_place = output.input_pieces[0] != nullptr;
  if (pinned_ && !output.pinned && !in_place) {
    const absl::Time stage_start = absl::Now();
    job->staging = pinned_->Acquire(total);
    if (job->staging) {
      char* staging = job->staging.data();
      std::memcpy(staging, problem.q, q_bytes);
      std::memcpy(staging + k_offset, problem.k, kv_bytes);
      std::memcpy(staging + v_offset, problem.v, kv_bytes);
      host_q = staging;
      host_k = staging + k_offset;
      host_v = staging + v_offset;
      host_o = staging + o_offset;
      host_lse = staging + lse_offset;
      job->stage_us = absl::ToInt64Microseconds(absl::Now() - stage_start);
    } else {
      spdlog::debug("pinned staging pool full: request served with pageable copies");
    }
  }

  Slot* slot = AcquireSlot(job->device_bytes);
  if (slot == nullptr) {
    return fail(absl::UnavailableError("a CUDA device faulted earlier; server not ready"));
  }
  Device* device = slot->device;
  if (absl::Now() >= output.deadline) {
    // It waited for a slot (every stream busy) past its deadline: not worth the device time.
    job->staging.reset();
    ReleaseSlot(slot, job->device_bytes);
    return fail(absl::DeadlineExceededError("deadline expired waiting for a GPU stream; not run"));
  }
  cudaSetDevice(device->index);
  cudaStream_t stream = slot->stream;

  char* base = nullptr;
  cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&base), total, stream);
  if (e != cudaSuccess) {
    absl::Status status;
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      status = absl::ResourceExhaustedError(
          absl::StrCat("GPU ", device->index, " out of memory for ", total, " bytes"));
    } else {
      status = DeviceError(device, e, "cudaMallocAsync");
    }
    job->staging.reset();
    ReleaseSlot(slot, job->device_bytes);
    return fail(std::move(status));
  }
  // Only now: every early return above answers through `fail`, which needs `done`.
  job->done = std::move(done);
  params.q = base;
  params.k = base + k_offset;
  params.v = base + v_offset;
  params.o = base + o_offset;
  params.lse = problem.return_lse ? reinterpret_cast<float*>(base + lse_offset) : nullptr;
  job->config = ChooseConfig(params, *device);

  // Everything below is queued on the stream; the first failure is kept and reported by the
  // completion thread, which waits for whatever was queued before it.
  auto step = [&job](cudaError_t result, const char* what) {
    if (result != cudaSuccess && job->launch_error == cudaSuccess) {
      job->launch_error = result;
      job->failed_step = what;
    }
    return job->launch_error == cudaSuccess;
  };
  step(cudaEventRecord(slot->events[0], stream), "cudaEventRecord");
  // Host buffers in the device layout (IoBuffers or a staging buffer) move in one copy each way:
  // per-copy latency is what a small request's h2d/d2h mostly is.
  const bool same_layout = !in_place && host_k == host_q + k_offset && host_v == host_q + v_offset &&
                           host_o == host_q + o_offset &&
                           (!problem.return_lse || host_lse == host_q + lse_offset);
  // O and LSE in one host buffer as on the device (a staging buffer, or IoBuffers -- with or
  // without room for the inputs): one D2H copy.
  const bool outputs_together =
      !problem.return_lse || ((job->staging || output.outputs_in_one_buffer) &&
                              host_lse == host_o + (lse_offset - o_offset));
  if (in_place) {
    step(CopyPiecesToDevice(output.input_pieces, base, {0, k_offset, v_offset}, stream,
                            &slot->batch),
         "H2D copy");
  } else if (same_layout) {
    step(cudaMemcpyAsync(base, host_q, v_offset + kv_bytes, cudaMemcpyHostToDevice, stream),
         "H2D copy");
  } else {
    step(cudaMemcpyAsync(base, host_q, q_bytes, cudaMemcpyHostToDevice, stream), "H2D copy");
    step(cudaMemcpyAsync(base + k_offset, host_k, kv_bytes, cudaMemcpyHostToDevice, stream),
         "H2D copy");
    step(cudaMemcpyAsync(base + v_offset, host_v, kv_bytes, cudaMemcpyHostToDevice, stream),
         "H2D copy");
  }
  step(cudaEventRecord(slot->events[1], stream), "cudaEventRecord");
  if (output.inject_device_fault && job->launch_error == cudaSuccess) {
    step(kernels::cuda::launch_fault_for_testing(stream), "kernel");
  } else if (job->launch_error == cudaSuccess &&
      step(kernels::cuda::run(params, job->config, stream), "kernel")) {
    step(cudaEventRecord(slot->events[2], stream), "cudaEventRecord");
    if (outputs_together) {
      const size_t out_end = problem.return_lse ? lse_offset + lse_bytes : o_offset + q_bytes;
      step(cudaMemcpyAsync(host_o, base + o_offset, out_end - o_offset, cudaMemcpyDeviceToHost,
                           stream),
           "D2H copy");
    } else {
      step(cudaMemcpyAsync(host_o, base + o_offset, q_bytes, cudaMemcpyDeviceToHost, stream),
           "D2H copy");
      if (problem.return_lse) {
        step(cudaMemcpyAsync(host_lse, base + lse_offset, lse_bytes, cudaMemcpyDeviceToHost,
                             stream),
             "D2H copy");
      }
    }
  }
  // Recorded even after a failure: the completion thread then waits for what was queued (the
  // H2D copies still read the staging buffer) before the buffer goes back to the pool.
  step(cudaEventRecord(slot->events[3], stream), "cudaEventRecord");
  step(cudaEventRecord(slot->events[4], stream), "cudaEventRecord");
  cudaFreeAsync(base, stream);

  // A job expected to finish within the polling window is completed right here: handing it to the
  // slot's completion thread would add that thread's wake-up (tens of microseconds on a loaded or
  // virtualized host) to a request that takes about as long on the GPU.
  if (completion_spin_us_ > 0 && PredictedDeviceUs(problem, layout) * 2 <= completion_spin_us_) {
    Complete(slot, std::move(job));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    slot->job = std::move(job);
  }
  slot->cv.notify_one();
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
  // its wake-up latency), then sleep on the blocking-sync twin of the same point in the stream.
  cudaError_t e = cudaEventQuery(slot->events[3]);
  if (e == cudaErrorNotReady && completion_spin_us_ > 0) {
    const auto spin_end =
        std::chrono::steady_clock::now() + std::chrono::microseconds(completion_spin_us_);
    do {
      e = cudaEventQuery(slot->events[3]);
    } while (e == cudaErrorNotReady && std::chrono::steady_clock::now() < spin_end);
  }
  if (e == cudaErrorNotReady) e = cudaEventSynchronize(slot->events[4]);
  const char* what = "stream work";
  if (job->launch_error != cudaSuccess) {
    e = job->launch_error;
    what = job->failed_step;
    // Wait for what did get queued before the staging buffer is reused.
    cudaStreamSynchronize(slot->stream);
  }
  if (e == cudaSuccess) {
    result.timing.stage_us = job->stage_us;
    result.timing.h2d_us = ElapsedUs(slot->events[0], slot->events[1]);
    result.timing.compute_us = ElapsedUs(slot->events[1], slot->events[2]);
    result.timing.d2h_us = ElapsedUs(slot->events[2], slot->events[3]);
    const AttentionProblem& problem = job->problem;
    if (job->staging) {
      // The one host copy on the way out: pinned staging -> the response's bytes.
      std::memcpy(job->output.out, job->staging.data() + job->o_offset,
                  size_t(problem.out_bytes()));
      if (problem.return_lse) {
        std::memcpy(job->output.lse, job->staging.data() + job->lse_offset,
                    size_t(problem.lse_elements()) * sizeof(float));
      }
    }
    result.kernel = absl::StrCat("sm80_fwd_", std::string(kernels::dtype_name(problem.dtype)),
                                 "_d", problem.head_dim, problem.causal ? "_causal_" : "_",
                                 job->config.name());
  } else {
    result.status = DeviceError(device, e, what);
  }
  job->staging.reset();
  JobDone done = std::move(job->done);
  const int64_t device_bytes = job->device_bytes;
  job.reset();
  ReleaseSlot(slot, device_bytes);
  done(std::move(result));
}

}  // namespace flashserve
