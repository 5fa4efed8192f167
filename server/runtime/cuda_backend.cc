// CudaBackend: its devices, their streams (slots) and completion threads, slot choice, device
// faults and the KV store. One request from launch to completion: cuda_backend_jobs.cc.
#include "runtime/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "autotune/kernel_choice.h"
#include "flashserve/kernels/cuda_attention.h"
#include "runtime/cuda_backend_internal.h"
#include "runtime/cuda_kv_store.h"
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
    case cudaErrorAssert:  // a device-side assert: the context is unusable (CUDA's docs)
      return true;
    default:
      return false;
  }
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
  backend->capabilities_.max_batch_and_heads = 65535;  // grid y / z (flash_fwd_dispatch.cu)
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
  choice.max_classes = options.tune_max_classes;
  choice.on_event = options.on_autotune_event;
  choice.stop_requested = options.stop_requested;
  const Device& first = *devices_.front();
  absl::StatusOr<std::unique_ptr<KernelChooser>> chooser =
      KernelChooser::Create(choice, first.index);
  if (!chooser.ok()) return chooser.status();
  chooser_ = std::move(*chooser);
  for (size_t i = 0; i < devices_.size(); ++i) {
    const DeviceDescription& d = capabilities_.devices[i];
    devices_[i]->tuned = chooser_->Covers({d.name, d.cc_major, d.cc_minor, devices_[i]->sm_count});
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

void CudaBackend::MarkUnhealthy(std::string_view why) {
  {
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (fault_.empty()) fault_ = std::string(why);
  }
  if (healthy_.exchange(false)) {
    spdlog::critical("{}; reporting not ready, further requests get UNAVAILABLE", why);
  }
  slot_cv_.notify_all();  // waiters re-check and give up
}

absl::Status CudaBackend::NotReady() const {
  std::lock_guard<std::mutex> lock(fault_mu_);
  return absl::UnavailableError(absl::StrCat(
      "server not ready: ", fault_.empty() ? "a CUDA device faulted earlier" : fault_));
}

absl::Status CudaBackend::DeviceError(Device* device, cudaError_t e, const char* what) {
  if (IsSticky(e)) {
    // A sticky error leaves CUDA unusable in the whole process, not only on this device: on two
    // H200s, after a fault on device 0 every call on device 1 failed too, from every thread
    // (bench/results/service-h100-h200x2-2026-11-22.md). So nothing runs any more; readiness
    // turns false so that the orchestrator replaces the process.
    MarkUnhealthy(absl::StrCat("CUDA device ", device->index, " faulted in ", what, " (",
                               cudaGetErrorString(e),
                               "): CUDA is unusable in this process, on every device"));
    return absl::InternalError(absl::StrCat("CUDA fault in ", what, ": ", cudaGetErrorString(e)));
  }
  cudaGetLastError();  // clear a non-sticky error raised on this thread (QueueWork clears its own)
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
  // Rows it accepted were lost: the sequences are unusable, and only a new process (its clients
  // re-creating them) repairs that.
  (*store)->set_on_broken(
      [this](const absl::Status& why) { MarkUnhealthy(std::string(why.message())); });
  return std::unique_ptr<kvcache::KvStore>(std::move(*store));
}

}  // namespace flashserve
