// The CUDA side of clients' shared-memory regions (memory/shm_regions.h): a system region is
// page-locked once (cudaHostRegister), so the backend DMAs it at pinned speed with no host copy;
// a CUDA region is opened once from its cudaIpcMemHandle on one of the server's devices, checked
// to lie inside the client's allocation, and closed when the region goes. Compiled only with CUDA.
#pragma once

#include <vector>

#include "memory/shm_regions.h"

namespace flashserve {

/// Thread-safe.
class CudaShmAccess final : public ShmDeviceAccess {
 public:
  /// `devices`: the CUDA device indices the server computes on.
  explicit CudaShmAccess(std::vector<int> devices) : devices_(std::move(devices)) {}
  bool PinHost(void* data, size_t bytes) override;
  void UnpinHost(void* data) override;
  absl::StatusOr<void*> OpenIpc(absl::string_view raw_handle, int device,
                                size_t bytes) override;
  void CloseIpc(void* base, int device) override;

  /// OK when [ptr, ptr + bytes) lies inside one device allocation (cuMemGetAddressRange).
  static absl::Status CheckInsideAllocation(const void* ptr, size_t bytes);

 private:
  const std::vector<int> devices_;
};

}  // namespace flashserve
