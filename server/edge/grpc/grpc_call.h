// What every gRPC call of the edge shares, in one place: its `method` label, request metrics,
// the log line of a failure and the one conversion of its absl::Status to a grpc::Status.
//
// Each handler -- native Attention (generic), GetServerInfo, the KServe v2 service, the striped
// stream service -- owns one GrpcCall per call and ends the call with
// `Finish(call.Finish(status))`. Health calls have none (probes would drown the request counts).
// The bearer token is not checked here but earlier, before a byte of the request is read, by the
// gate in edge/grpc/grpc_auth.h; the calls it refuses are counted with RecordRefusedCall below, so
// every call of a method lands in the same series.
//
// Why a per-call object and not a gRPC server interceptor: gRPC 1.51's server interceptors can
// watch a call but not end it (Hijack is client-side only), so they cannot refuse anything, and
// they cannot see what a handler knows -- when the request was complete (the clock starts there,
// not at the first byte), its request id, and the response's size when its bytes go out as slices
// of the backend's buffers. An object the handler holds knows all of it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"
#include "metrics/server_metrics.h"

namespace flashserve {

/// One method the gRPC edge serves: its full path, its `method` label, and whether its calls
/// hand a request to the runtime (those count in flashserve_inflight_requests while they run).
struct GrpcMethod {
  std::string_view path;
  std::string_view label;
  bool computes = false;
};

namespace grpc_methods {
inline constexpr GrpcMethod kAttention{"/flashserve.v1.AttentionService/Attention", "Attention",
                                       true};
inline constexpr GrpcMethod kGetServerInfo{"/flashserve.v1.AttentionService/GetServerInfo",
                                           "GetServerInfo"};
inline constexpr GrpcMethod kModelInfer{"/inference.GRPCInferenceService/ModelInfer", "ModelInfer",
                                        true};
inline constexpr GrpcMethod kModelReady{"/inference.GRPCInferenceService/ModelReady", "ModelReady"};
inline constexpr GrpcMethod kServerMetadata{"/inference.GRPCInferenceService/ServerMetadata",
                                            "ServerMetadata"};
inline constexpr GrpcMethod kModelMetadata{"/inference.GRPCInferenceService/ModelMetadata",
                                           "ModelMetadata"};
#define FLASHSERVE_SHM_METHOD(name) \
  inline constexpr GrpcMethod k##name{"/inference.GRPCInferenceService/" #name, #name};
// Triton's shared-memory extension (edge/grpc/kserve_shm_grpc.cc).
FLASHSERVE_SHM_METHOD(SystemSharedMemoryStatus)
FLASHSERVE_SHM_METHOD(SystemSharedMemoryRegister)
FLASHSERVE_SHM_METHOD(SystemSharedMemoryUnregister)
FLASHSERVE_SHM_METHOD(CudaSharedMemoryStatus)
FLASHSERVE_SHM_METHOD(CudaSharedMemoryRegister)
FLASHSERVE_SHM_METHOD(CudaSharedMemoryUnregister)
#undef FLASHSERVE_SHM_METHOD
inline constexpr GrpcMethod kOpenSession{"/flashserve.v1.AttentionStreamService/OpenSession",
                                         "OpenSession"};
inline constexpr GrpcMethod kUpload{"/flashserve.v1.AttentionStreamService/Upload", "Upload"};
inline constexpr GrpcMethod kCompute{"/flashserve.v1.AttentionStreamService/Compute", "Compute",
                                     true};
inline constexpr GrpcMethod kDownload{"/flashserve.v1.AttentionStreamService/Download", "Download"};
inline constexpr GrpcMethod kCloseSession{"/flashserve.v1.AttentionStreamService/CloseSession",
                                          "CloseSession"};
inline constexpr GrpcMethod kCreateSequence{"/flashserve.v1.Sequences/CreateSequence",
                                            "CreateSequence"};
inline constexpr GrpcMethod kAppend{"/flashserve.v1.Sequences/Append", "Append"};
inline constexpr GrpcMethod kAttend{"/flashserve.v1.Sequences/Attend", "Attend", true};
inline constexpr GrpcMethod kDecodeStep{"/flashserve.v1.Sequences/DecodeStep", "DecodeStep", true};
inline constexpr GrpcMethod kRelease{"/flashserve.v1.Sequences/Release", "Release"};
inline constexpr GrpcMethod kGetSequenceInfo{"/flashserve.v1.Sequences/GetSequenceInfo",
                                             "GetSequenceInfo"};
inline constexpr GrpcMethod kGetKvPoolInfo{"/flashserve.v1.Sequences/GetKvPoolInfo",
                                           "GetKvPoolInfo"};
/// The label of calls to any other path (gRPC's reflection, unknown methods) refused by the
/// token gate: a fixed label, so made-up paths cannot grow the series without bound.
inline constexpr std::string_view kOtherLabel = "other";
}  // namespace grpc_methods

/// Every method above, in a fixed order.
const std::vector<GrpcMethod>& GrpcMethods();
/// The `method` label values the gRPC edge records (those above, then kOtherLabel): for
/// ServerMetricsOptions::methods, so each series exists from startup.
std::vector<std::string> GrpcMethodLabels();
/// The method serving `path`, or null (health, reflection, unknown paths).
const GrpcMethod* FindGrpcMethod(std::string_view path);

/// A call refused before any handler ran (the token gate): requests_total{method,status} += 1
/// with zero duration and bytes, and one warning line. `metrics` may be null.
void RecordRefusedCall(ServerMetrics* metrics, std::string_view label, const absl::Status& status);

/// One call's bookkeeping, from the handler's first look at it to Finish. Not thread-safe: one
/// owner at a time (the reactor, the runtime's done callback, or the hot lane, in turn).
class GrpcCall {
 public:
  /// `metrics` may be null (then nothing is recorded; failures are still logged).
  GrpcCall(ServerMetrics* metrics, const GrpcMethod& method);
  /// A call never finished (the reactor was torn down first) leaves inflight_requests as it was.
  ~GrpcCall();
  GrpcCall(const GrpcCall&) = delete;
  GrpcCall& operator=(const GrpcCall&) = delete;

  /// The request is complete (unary) or the call has begun (streams): request_duration_seconds
  /// is measured from here (0 for a call that fails before), `bytes` count as received, and a
  /// computing method counts in inflight_requests until Finish. At most once.
  void Start(int64_t bytes_in = 0);
  /// When Start was called; InfinitePast before.
  absl::Time started() const { return started_; }
  void AddBytesIn(int64_t bytes) { bytes_in_ += bytes; }
  void AddBytesOut(int64_t bytes) { bytes_out_ += bytes; }
  int64_t bytes_in() const { return bytes_in_; }
  /// Named in the failure log line: the request's id, a stream's session.
  void set_request_id(std::string_view id) { request_id_.assign(id.substr(0, 256)); }
  void set_session_id(std::string_view id) { session_id_.assign(id.substr(0, 64)); }

  /// Ends the call's bookkeeping: requests_total{method,status} += 1, the duration, the bytes
  /// (sent only when `status` is ok), a warning line for a failure; returns the status to finish
  /// the call with -- the one absl -> gRPC conversion of the edge. Exactly once.
  grpc::Status Finish(const absl::Status& status);
  bool finished() const { return finished_; }

 private:
  ServerMetrics* const metrics_;
  const GrpcMethod& method_;
  absl::Time started_ = absl::InfinitePast();
  int64_t bytes_in_ = 0;
  int64_t bytes_out_ = 0;
  std::string request_id_;
  std::string session_id_;
  bool inflight_ = false;
  bool finished_ = false;
};

}  // namespace flashserve
