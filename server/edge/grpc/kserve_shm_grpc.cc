#include "edge/grpc/kserve_shm_grpc.h"

#include "common/status_macros.h"
#include "runtime/shm_requests.h"

namespace flashserve::kserve {

// Regions belong to an owner (memory/shm_regions.h); with the server's one bearer token every
// caller allowed in is the same owner.
constexpr char kOwner[] = "";

absl::Status SystemShmStatus(AttentionRuntime& runtime,
                             const inference::SystemSharedMemoryStatusRequest& request,
                             inference::SystemSharedMemoryStatusResponse* response) {
  ASSIGN_OR_RETURN(std::vector<ShmRegionInfo> regions,
                   ShmStatus(runtime, ShmType::kSystem, request.name(), kOwner));
  for (const ShmRegionInfo& r : regions) {
    auto& status = (*response->mutable_regions())[r.name];
    status.set_name(r.name);
    status.set_key(r.key);
    status.set_offset(r.offset);
    status.set_byte_size(r.byte_size);
  }
  return absl::OkStatus();
}

absl::Status SystemShmRegister(AttentionRuntime& runtime,
                               const inference::SystemSharedMemoryRegisterRequest& request) {
  return RegisterSystemShm(runtime, request.name(), request.key(), request.offset(),
                           request.byte_size(), kOwner);
}

absl::Status SystemShmUnregister(AttentionRuntime& runtime,
                                 const inference::SystemSharedMemoryUnregisterRequest& request) {
  return UnregisterShm(runtime, ShmType::kSystem, request.name(), kOwner);
}

absl::Status CudaShmStatus(AttentionRuntime& runtime,
                           const inference::CudaSharedMemoryStatusRequest& request,
                           inference::CudaSharedMemoryStatusResponse* response) {
  ASSIGN_OR_RETURN(std::vector<ShmRegionInfo> regions,
                   ShmStatus(runtime, ShmType::kCuda, request.name(), kOwner));
  for (const ShmRegionInfo& r : regions) {
    auto& status = (*response->mutable_regions())[r.name];
    status.set_name(r.name);
    status.set_device_id(uint64_t(r.device));
    status.set_byte_size(r.byte_size);
  }
  return absl::OkStatus();
}

absl::Status CudaShmRegister(AttentionRuntime& runtime,
                             const inference::CudaSharedMemoryRegisterRequest& request) {
  return RegisterCudaShm(runtime, request.name(), request.raw_handle(), request.device_id(),
                         request.byte_size(), kOwner);
}

absl::Status CudaShmUnregister(AttentionRuntime& runtime,
                               const inference::CudaSharedMemoryUnregisterRequest& request) {
  return UnregisterShm(runtime, ShmType::kCuda, request.name(), kOwner);
}

}  // namespace flashserve::kserve
