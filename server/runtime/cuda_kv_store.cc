#include "runtime/cuda_kv_store.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "flashserve/kernels/decode_attention.h"
#include "runtime/kv_scatter.h"

// The store's life: its pool, stream, stage and launch slots. Writes are in cuda_kv_writes.cc,
// decode launches in cuda_kv_launch.cc.

namespace flashserve {

absl::StatusOr<std::unique_ptr<CudaKvStore>> CudaKvStore::Create(int64_t bytes, int device,
                                                                 int launches_in_flight,
                                                                 SplitChooser choose_splits,
                                                                 ErrorHandler on_error) {
  if (launches_in_flight < 1) {
    return absl::InvalidArgumentError("the KV store needs at least one launch in flight");
  }
  auto store = std::unique_ptr<CudaKvStore>(
      new CudaKvStore(bytes, device, std::move(choose_splits), std::move(on_error)));
  cudaSetDevice(device);
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&store->pool_), size_t(bytes));
  if (e != cudaSuccess) {
    cudaGetLastError();
    // More than the device has for it (SequenceRuntime names the flag): exit 2, like the CPU pool.
    // What the device had free tells the operator what to ask for instead.
    size_t free_bytes = 0, total_bytes = 0;
    const bool known = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    if (!known) cudaGetLastError();
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot allocate ", bytes, " bytes of device memory for the KV cache: ",
        cudaGetErrorString(e),
        known ? absl::StrCat(" (device ", device, " had ", free_bytes, " of its ", total_bytes,
                             " bytes free)")
              : ""));
  }
  if ((e = cudaStreamCreateWithFlags(&store->stream_, cudaStreamNonBlocking)) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA stream: ", cudaGetErrorString(e)));
  }
  static_assert(sizeof(KvScatterRange) == 24, "kRangeBytes assumes 24-byte ranges");
  int can_use_host_pointer = 0;
  if (cudaDeviceGetAttribute(&can_use_host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem,
                             device) != cudaSuccess) {
    cudaGetLastError();
  }
  store->host_addressable_ = can_use_host_pointer != 0;
  const size_t stage = size_t(kStageBytes);
  store->staged_ranges_host_.resize(size_t(kRangeBytes));
  e = cudaMalloc(reinterpret_cast<void**>(&store->stage_device_), stage);
  for (int s = 0; s < launches_in_flight && e == cudaSuccess; ++s) {
    store->slots_.push_back(std::make_unique<LaunchSlot>());
    for (cudaEvent_t& event : store->slots_.back()->events) {
      if (e == cudaSuccess) e = cudaEventCreate(&event);
    }
  }
  for (int i = 0; i < 2 && e == cudaSuccess; ++i) {
    e = cudaHostAlloc(reinterpret_cast<void**>(&store->stage_host_[i]), stage,
                      cudaHostAllocDefault);
    if (e == cudaSuccess) {
      e = cudaEventCreateWithFlags(&store->stage_done_[i], cudaEventDisableTiming);
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache write stage: ", cudaGetErrorString(e)));
  }
  return store;
}

CudaKvStore::~CudaKvStore() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  cudaFree(pool_);
  for (const std::unique_ptr<LaunchSlot>& slot : slots_) {
    cudaFree(slot->device_scratch);
    cudaFreeHost(slot->host_scratch);
    for (cudaEvent_t event : slot->events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  cudaFree(stage_device_);
  for (int i = 0; i < 2; ++i) {
    cudaFreeHost(stage_host_[i]);
    if (stage_done_[i] != nullptr) cudaEventDestroy(stage_done_[i]);
  }
}

std::vector<int> CudaKvStore::head_dims() const { return kernels::cuda::decode_head_dims(); }

bool CudaKvStore::Addressable(kvcache::BytesAt at) const {
  return at == kvcache::BytesAt::kDevice ||
         (at == kvcache::BytesAt::kPageLocked && host_addressable_);
}

absl::Status CudaKvStore::Reserve(bool device, int64_t bytes, void** buffer, int64_t* capacity) {
  if (bytes <= *capacity) return absl::OkStatus();
  const int64_t grown = std::max(bytes, *capacity * 2);
  if (device) {
    cudaFree(*buffer);
  } else {
    cudaFreeHost(*buffer);
  }
  *buffer = nullptr;
  *capacity = 0;
  const auto allocate = [&](int64_t n) {
    const cudaError_t e = device ? cudaMalloc(buffer, size_t(n))
                                 : cudaHostAlloc(buffer, size_t(n), cudaHostAllocDefault);
    if (e != cudaSuccess) cudaGetLastError();  // not the next launch's error
    return e;
  };
  cudaError_t e = allocate(grown);
  int64_t got = grown;
  if (e != cudaSuccess && grown > bytes) {  // the doubling may not fit where the need does
    e = allocate(bytes);
    got = bytes;
  }
  if (e != cudaSuccess) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV launch scratch of ", bytes, " bytes: ", cudaGetErrorString(e)));
  }
  *capacity = got;
  return absl::OkStatus();
}

}  // namespace flashserve
