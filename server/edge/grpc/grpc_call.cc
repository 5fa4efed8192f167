#include "edge/grpc/grpc_call.h"

#include "absl/time/clock.h"
#include "common/logging.h"
#include "edge/grpc/grpc_status.h"
#include "spdlog/spdlog.h"

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

void RecordRefusedCall(ServerMetrics* metrics, std::string_view label, const absl::Status& status) {
  if (metrics != nullptr) {
    metrics->RecordRequest(label, static_cast<int>(status.code()), 0.0, 0, 0);
  }
  spdlog::warn("{} refused: code={} message=\"{}\"", label, absl::StatusCodeToString(status.code()),
               std::string(status.message()));
}

GrpcCall::GrpcCall(ServerMetrics* metrics, const GrpcMethod& method)
    : metrics_(metrics), method_(method) {}

GrpcCall::~GrpcCall() {
  if (inflight_) metrics_->InflightDec();
}

void GrpcCall::Start(int64_t bytes_in) {
  if (started_ != absl::InfinitePast()) return;
  started_ = absl::Now();
  bytes_in_ += bytes_in;
  if (method_.computes && metrics_ != nullptr) {
    metrics_->InflightInc();
    inflight_ = true;
  }
}

grpc::Status GrpcCall::Finish(const absl::Status& status) {
  if (finished_) {
    spdlog::error("{}: GrpcCall::Finish called twice", method_.label);
    return ToGrpcStatus(status);
  }
  finished_ = true;
  if (metrics_ != nullptr) {
    if (inflight_) metrics_->InflightDec();
    inflight_ = false;
    const double seconds =
        started_ == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(absl::Now() - started_);
    metrics_->RecordRequest(method_.label, static_cast<int>(status.code()), seconds, bytes_in_,
                            status.ok() ? bytes_out_ : 0);
  }
  if (!status.ok()) {
    spdlog::warn("{} failed: request_id=\"{}\"{}{} code={} message=\"{}\"", method_.label,
                 LogSafe(request_id_), session_id_.empty() ? "" : " session=", LogSafe(session_id_),
                 absl::StatusCodeToString(status.code()), std::string(status.message()));
  }
  return ToGrpcStatus(status);
}

}  // namespace flashserve
