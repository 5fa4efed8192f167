// Triton's shared-memory extension on the KServe gRPC service: the six calls' work, between
// the messages (inference/open_inference_grpc.proto) and the region registry
// (runtime/shm_requests.h). The service (kserve_grpc.cc) wraps each in its GrpcCall.
#pragma once

#include "absl/status/status.h"
#include "inference/open_inference_grpc.pb.h"
#include "runtime/attention_runtime.h"

namespace flashserve::kserve {

absl::Status SystemShmStatus(AttentionRuntime& runtime,
                             const inference::SystemSharedMemoryStatusRequest& request,
                             inference::SystemSharedMemoryStatusResponse* response);
absl::Status SystemShmRegister(AttentionRuntime& runtime,
                               const inference::SystemSharedMemoryRegisterRequest& request);
absl::Status SystemShmUnregister(AttentionRuntime& runtime,
                                 const inference::SystemSharedMemoryUnregisterRequest& request);
absl::Status CudaShmStatus(AttentionRuntime& runtime,
                           const inference::CudaSharedMemoryStatusRequest& request,
                           inference::CudaSharedMemoryStatusResponse* response);
absl::Status CudaShmRegister(AttentionRuntime& runtime,
                             const inference::CudaSharedMemoryRegisterRequest& request);
absl::Status CudaShmUnregister(AttentionRuntime& runtime,
                               const inference::CudaSharedMemoryUnregisterRequest& request);

}  // namespace flashserve::kserve
