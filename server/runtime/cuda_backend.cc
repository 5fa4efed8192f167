#include "runtime/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "autotune/cuda_tuning.h"
#include "autotune/problem_class.h"
#include "flashserve/kernels/cuda_attention.h"
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

int64_t ElapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0.f;
  return cudaEventElapsedTime(&ms, a, b) == cudaSuccess ? int64_t(ms * 1000.f) : 0;
}

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct CudaBackend::Slot {
  cudaStream_t stream = nullptr;
  cudaEvent_t events[4] = {};  // start, after H2D, after kernel, after D2H
  bool busy = false;
};

struct CudaBackend::Device {
  int index = 0;
  int sm_count = 0;
  bool tuned = false;  // same model as the first device: uses the tuning cache
  std::vector<Slot> slots;
  int in_flight = 0;
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
    device->slots.resize(size_t(std::max(1, options.streams_per_device)));
    cudaSetDevice(index);
    for (Slot& slot : device->slots) {
      if ((e = cudaStreamCreateWithFlags(&slot.stream, cudaStreamNonBlocking)) != cudaSuccess) {
        return absl::UnavailableError(absl::StrCat("CUDA stream: ", cudaGetErrorString(e)));
      }
      for (cudaEvent_t& event : slot.events) cudaEventCreate(&event);
    }
    // Keep freed device memory in the stream-ordered pool instead of returning it to the driver
    // after every request (the default threshold 0 would re-map memory each time).
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, index) == cudaSuccess) {
      uint64_t threshold = uint64_t{4} << 30;
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
  if (absl::Status s = backend->StartAutotune(options); !s.ok()) return s;
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
  for (auto& device : devices_) {
    cudaSetDevice(device->index);
    for (Slot& slot : device->slots) {
      for (cudaEvent_t event : slot.events) cudaEventDestroy(event);
      cudaStreamDestroy(slot.stream);
    }
  }
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

int CudaBackend::recommended_concurrency() const {
  int n = 0;
  for (const auto& device : devices_) n += int(device->slots.size());
  return n;
}

// The scheduler runs at most recommended_concurrency() jobs at once, so a free slot exists.
CudaBackend::Slot* CudaBackend::Acquire(Device** chosen) {
  std::lock_guard<std::mutex> lock(mu_);
  Device* best = nullptr;
  for (auto& device : devices_) {
    if (best == nullptr || device->in_flight < best->in_flight) best = device.get();
  }
  for (Slot& slot : best->slots) {
    if (!slot.busy) {
      slot.busy = true;
      best->in_flight++;
      *chosen = best;
      return &slot;
    }
  }
  return nullptr;
}

void CudaBackend::Release(Device* device, Slot* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  slot->busy = false;
  device->in_flight--;
}

absl::Status CudaBackend::Run(const AttentionProblem& problem, const JobOutput& output,
                              PhaseTiming* timing, std::string* kernel) {
  if (!healthy()) return absl::UnavailableError("CUDA device faulted earlier; server not ready");
  Device* device = nullptr;
  Slot* slot = Acquire(&device);
  if (slot == nullptr) return absl::ResourceExhaustedError("no free CUDA stream");
  struct Releaser {
    CudaBackend* self;
    Device* device;
    Slot* slot;
    ~Releaser() { self->Release(device, slot); }
  } releaser{this, device, slot};

  cudaSetDevice(device->index);
  cudaStream_t stream = slot->stream;
  const size_t q_bytes = size_t(problem.q_bytes()), kv_bytes = size_t(problem.kv_bytes());
  const size_t lse_bytes = size_t(problem.lse_elements()) * sizeof(float);
  const size_t total = AlignUp(q_bytes) * 2 + AlignUp(kv_bytes) * 2 + AlignUp(lse_bytes);

  char* base = nullptr;
  cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&base), total, stream);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e == cudaErrorMemoryAllocation) {
      return absl::ResourceExhaustedError(
          absl::StrCat("GPU ", device->index, " out of memory for ", total, " bytes"));
    }
    return absl::InternalError(absl::StrCat("cudaMallocAsync: ", cudaGetErrorString(e)));
  }
  char* q = base;
  char* o = q + AlignUp(q_bytes);
  char* k = o + AlignUp(q_bytes);
  char* v = k + AlignUp(kv_bytes);
  float* lse = problem.return_lse ? reinterpret_cast<float*>(v + AlignUp(kv_bytes)) : nullptr;

  kernels::AttentionParams params = problem.params();
  params.q = q;
  params.k = k;
  params.v = v;
  params.o = o;
  params.lse = lse;
  absl::Status status;
  if (std::string why = kernels::cuda::supported(params); !why.empty()) {
    status = absl::InvalidArgumentError(why);
  } else {
    const kernels::cuda::KernelConfig config = ChooseConfig(params, *device);
    cudaEventRecord(slot->events[0], stream);
    cudaMemcpyAsync(q, problem.q, q_bytes, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(k, problem.k, kv_bytes, cudaMemcpyHostToDevice, stream);
    cudaMemcpyAsync(v, problem.v, kv_bytes, cudaMemcpyHostToDevice, stream);
    cudaEventRecord(slot->events[1], stream);
    e = kernels::cuda::run(params, config, stream);
    cudaEventRecord(slot->events[2], stream);
    if (e == cudaSuccess) {
      cudaMemcpyAsync(output.out, o, q_bytes, cudaMemcpyDeviceToHost, stream);
      if (lse != nullptr)
        cudaMemcpyAsync(output.lse, lse, lse_bytes, cudaMemcpyDeviceToHost, stream);
    }
    cudaEventRecord(slot->events[3], stream);
    cudaError_t sync = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = sync;
    if (e == cudaSuccess) {
      timing->h2d_us = ElapsedUs(slot->events[0], slot->events[1]);
      timing->compute_us = ElapsedUs(slot->events[1], slot->events[2]);
      timing->d2h_us = ElapsedUs(slot->events[2], slot->events[3]);
      *kernel = absl::StrCat("sm80_fwd_", std::string(kernels::dtype_name(problem.dtype)), "_d",
                             problem.head_dim, problem.causal ? "_causal_" : "_", config.name());
    } else if (IsSticky(e)) {
      healthy_.store(false);
      spdlog::critical("CUDA device {} faulted ({}): reporting not ready", device->index,
                       cudaGetErrorString(e));
      status = absl::InternalError(absl::StrCat("CUDA fault: ", cudaGetErrorString(e)));
    } else {
      cudaGetLastError();
      status = absl::InternalError(absl::StrCat("CUDA: ", cudaGetErrorString(e)));
    }
  }
  cudaFreeAsync(base, stream);
  return status;
}

}  // namespace flashserve
