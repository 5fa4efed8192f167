#include "runtime/cuda_shm_access.h"

#include <cuda.h>  // types of cuMemGetAddressRange only: it is reached through the runtime
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

// cuMemGetAddressRange without linking the driver library: through the runtime's entry points.
GetAddressRange AddressRangeFunction() {
  static GetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuMemGetAddressRange", &p, cudaEnableDefault,
                                                  &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRange(nullptr);
    }
    return reinterpret_cast<GetAddressRange>(p);
  }();
  return fn;
}

}  // namespace

bool CudaShmAccess::PinHost(void* data, size_t bytes) {
  const cudaError_t e = cudaHostRegister(data, bytes, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: the region stays pageable and is staged as before
    spdlog::warn("shared-memory region of {} bytes stays pageable: cudaHostRegister: {}", bytes,
                 cudaGetErrorString(e));
    return false;
  }
  return true;
}

void CudaShmAccess::UnpinHost(void* data) {
  if (cudaHostUnregister(data) != cudaSuccess) cudaGetLastError();
}

absl::Status CudaShmAccess::CheckInsideAllocation(const void* ptr, size_t bytes) {
  GetAddressRange range = AddressRangeFunction();
  if (range == nullptr) return absl::OkStatus();  // old driver: cannot check, trust byte_size
  CUdeviceptr base = 0;
  size_t size = 0;
  if (range(&base, &size, CUdeviceptr(reinterpret_cast<uintptr_t>(ptr))) != CUDA_SUCCESS) {
    return absl::InvalidArgumentError("raw_handle: the opened memory has no allocation");
  }
  const size_t from = size_t(reinterpret_cast<uintptr_t>(ptr) - base);
  if (from > size || bytes > size - from) {
    return absl::InvalidArgumentError(absl::StrCat(
        "byte_size: ", bytes, " bytes, but the client's allocation has ", size - from));
  }
  return absl::OkStatus();
}

absl::StatusOr<void*> CudaShmAccess::OpenIpc(absl::string_view raw_handle, int device,
                                             size_t bytes) {
  cudaIpcMemHandle_t handle;
  if (raw_handle.size() != sizeof(handle)) {
    return absl::InvalidArgumentError(absl::StrCat("raw_handle: ", raw_handle.size(),
                                                   " bytes, a cudaIpcMemHandle has ",
                                                   sizeof(handle)));
  }
  if (std::find(devices_.begin(), devices_.end(), device) == devices_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("device_id: ", device,
                                                   " is not a device of this server (",
                                                   absl::StrJoin(devices_, ","), ")"));
  }
  std::memcpy(&handle, raw_handle.data(), sizeof(handle));
  cudaSetDevice(device);
  void* ptr = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // a bad handle is not a sticky error
    return absl::InvalidArgumentError(
        absl::StrCat("raw_handle: cudaIpcOpenMemHandle on device ", device, ": ",
                     cudaGetErrorString(e),
                     " (a handle from another process, on this host, of that device)"));
  }
  if (absl::Status inside = CheckInsideAllocation(ptr, bytes); !inside.ok()) {
    cudaIpcCloseMemHandle(ptr);
    return inside;
  }
  return ptr;
}

void CudaShmAccess::CloseIpc(void* base, int device) {
  cudaSetDevice(device);
  if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
}

}  // namespace flashserve
