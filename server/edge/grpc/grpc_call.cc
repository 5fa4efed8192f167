#include "edge/grpc/grpc_call.h"

#include "common/protobuf_errors.h"
#include "grpcpp/impl/codegen/proto_utils.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "grpcpp/support/proto_buffer_writer.h"

namespace flashserve {

absl::Status ParseRequest(const grpc::ByteBuffer& raw, google::protobuf::MessageLite* message) {
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&raw));  // reads only
  return ParseMessage(&reader, message);
}

absl::Status SerializeAnswer(const google::protobuf::MessageLite& response,
                             grpc::ByteBuffer* raw_response) {
  bool own_buffer = false;
  const grpc::Status s =
      grpc::GenericSerialize<grpc::ProtoBufferWriter, google::protobuf::MessageLite>(
          response, raw_response, &own_buffer);
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError("the answer could not be serialized: " + s.error_message());
}

void FinishUnary(grpc::ServerUnaryReactor* reactor, GrpcCall* call, absl::Status status,
                 const google::protobuf::MessageLite& response, grpc::ByteBuffer* raw_response) {
  if (status.ok()) status = SerializeAnswer(response, raw_response);
  if (status.ok()) call->AddBytesOut(int64_t(raw_response->Length()));
  reactor->Finish(call->Finish(status));
}

grpc::ServerUnaryReactor* AnswerUnary(grpc::CallbackServerContext* context, GrpcCall* call,
                                      const absl::Status& status,
                                      const google::protobuf::MessageLite& response,
                                      grpc::ByteBuffer* raw_response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  FinishUnary(reactor, call, status, response, raw_response);
  return reactor;
}

const std::vector<GrpcMethod>& GrpcMethods() {
  using namespace grpc_methods;  // NOLINT(build/namespaces): the table below reads better
  // One service per line (clang-format would put one method per line).
  // clang-format off
  static const std::vector<GrpcMethod> methods = {
      kAttention,   kGetServerInfo, kModelInfer, kModelReady, kServerMetadata, kModelMetadata,
      kOpenSession, kUpload,        kCompute,    kDownload,   kCloseSession,
      kCreateSequence, kAppend, kTruncate, kAttend, kDecodeStep, kRelease, kGetSequenceInfo,
      kGetKvPoolInfo,
      kSystemSharedMemoryStatus, kSystemSharedMemoryRegister, kSystemSharedMemoryUnregister,
      kCudaSharedMemoryStatus,   kCudaSharedMemoryRegister,   kCudaSharedMemoryUnregister};
  // clang-format on
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
