#include "edge/grpc/grpc_call.h"

namespace flashserve {

const std::vector<GrpcMethod>& GrpcMethods() {
  using namespace grpc_methods;  // NOLINT(build/namespaces): the table below reads better
  static const std::vector<GrpcMethod> methods = {
      kAttention,   kGetServerInfo, kModelInfer, kModelReady, kServerMetadata, kModelMetadata,
      kOpenSession, kUpload,        kCompute,    kDownload,   kCloseSession,
      kCreateSequence, kAppend, kAttend, kDecodeStep, kRelease, kGetSequenceInfo, kGetKvPoolInfo,
      kSystemSharedMemoryStatus, kSystemSharedMemoryRegister, kSystemSharedMemoryUnregister,
      kCudaSharedMemoryStatus,   kCudaSharedMemoryRegister,   kCudaSharedMemoryUnregister};
  return methods;
}

std::vector<std::string> GrpcMethodLabels() {
  std::vector<std::string> labels;
  for (const GrpcMethod& method : GrpcMethods()) labels.emplace_back(method.label);
  labels.emplace_back(grpc_methods::kOtherLabel);
  return labels;
}

const GrpcMethod* FindGrpcMethod(std::string_view path) {
  for (const GrpcMethod& method : GrpcMethods()) {
    if (method.path == path) return &method;
  }
  return nullptr;
}

}  // namespace flashserve
