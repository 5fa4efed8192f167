// What every gRPC call of the edge shares, in one place: its method's path and `method` label, and
// GrpcCall -- the transport-neutral bookkeeping of edge/call/edge_call.h (request metrics, the log
// line of a failure) plus the one conversion of its absl::Status to a grpc::Status.
//
// Each handler -- native Attention (generic), GetServerInfo, the KServe v2 service, the striped
// stream service -- owns one GrpcCall per call and ends the call with
// `Finish(call.Finish(status))`. Health calls have none (probes would drown the request counts).
// The bearer token is not checked here but earlier, before a byte of the request is read, by the
// gate in edge/grpc/grpc_auth.h; the calls it refuses are counted with RecordRefusedCall
// (edge/call/edge_call.h), so every call of a method lands in the same series.
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
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "edge/call/edge_call.h"
#include "edge/grpc/grpc_status.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/status.h"
#include "metrics/server_metrics.h"

namespace flashserve {

/// The most bytes of O and LSE an answer may carry in its message: gRPC sends none past 2 GiB
/// (INT_MAX), less room for the answer's other fields. Larger answers are refused before they are
/// computed (AttentionRuntime::Call::max_inline_answer_bytes).
inline constexpr int64_t kMaxInlineAnswerBytes = int64_t{2147483647} - (int64_t{1} << 20);

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
inline constexpr GrpcMethod kTruncate{"/flashserve.v1.Sequences/Truncate", "Truncate"};
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

/// One gRPC call's bookkeeping (EdgeCall: metrics, the failure log line) whose Finish also gives
/// the status to finish the call with -- the one absl -> gRPC conversion of the edge.
class GrpcCall : public EdgeCall {
 public:
  /// `metrics` may be null (then nothing is recorded; failures are still logged).
  GrpcCall(ServerMetrics* metrics, const GrpcMethod& method)
      : EdgeCall(metrics, CallMethod{method.label, method.computes}) {}

  /// EdgeCall::Finish, then `status` as a grpc::Status. Exactly once.
  grpc::Status Finish(const absl::Status& status) {
    EdgeCall::Finish(status);
    return ToGrpcStatus(status);
  }
};

// Every method of the edge is registered raw (request and answer as bytes) and parses its own
// request: gRPC's typed callback methods answer a request that does not parse (truncated, a
// proto3 string that is not UTF-8) UNIMPLEMENTED with no message before any handler runs --
// uncounted, and read by clients as "no such method".

/// A generated service with each of its methods' `WithRawCallbackMethod_X` templates applied:
/// `Wrapped<S::Service, S::WithRawCallbackMethod_A, S::WithRawCallbackMethod_B>` is
/// `S::WithRawCallbackMethod_A<S::WithRawCallbackMethod_B<S::Service>>`.
template <typename Base, template <typename> class... Wrappers>
struct WrappedService {
  using type = Base;
};
template <typename Base, template <typename> class First, template <typename> class... Rest>
struct WrappedService<Base, First, Rest...> {
  using type = First<typename WrappedService<Base, Rest...>::type>;
};
template <typename Base, template <typename> class... Wrappers>
using Wrapped = typename WrappedService<Base, Wrappers...>::type;

/// `raw` parsed into `message`; INVALID_ARGUMENT naming the message (and the field protobuf
/// named) when it does not parse (common/protobuf_errors.h).
absl::Status ParseRequest(const grpc::ByteBuffer& raw, google::protobuf::MessageLite* message);

/// Ends a unary call: when `status` is ok, `response` is serialized into the raw method's
/// `raw_response` and counted as sent; then `reactor` finishes with `status`.
void FinishUnary(grpc::ServerUnaryReactor* reactor, GrpcCall* call, absl::Status status,
                 const google::protobuf::MessageLite& response, grpc::ByteBuffer* raw_response);
/// FinishUnary on the call's default reactor, for a handler that answers before it returns.
grpc::ServerUnaryReactor* AnswerUnary(grpc::CallbackServerContext* context, GrpcCall* call,
                                      const absl::Status& status,
                                      const google::protobuf::MessageLite& response,
                                      grpc::ByteBuffer* raw_response);

/// `response` into a raw method's answer (INTERNAL only past protobuf's 2 GiB).
absl::Status SerializeAnswer(const google::protobuf::MessageLite& response,
                             grpc::ByteBuffer* raw_response);

/// A raw unary call served on any thread: parses the request, runs `run(request, &response,
/// call)` unless it did not parse, and finishes `reactor` with the answer (`call` started).
template <typename Request, typename Response, typename Run>
void RunUnary(grpc::ServerUnaryReactor* reactor, GrpcCall* call,
              const grpc::ByteBuffer& raw_request, grpc::ByteBuffer* raw_response, Run&& run) {
  Request request;
  Response response;
  absl::Status status = ParseRequest(raw_request, &request);
  if (status.ok()) status = run(request, &response, call);
  FinishUnary(reactor, call, status, response, raw_response);
}

/// A raw unary method answered on gRPC's thread, recorded as `method` in `metrics` (may be null):
/// parses the request, runs `run(request, &response, &call)` unless it did not parse, answers.
template <typename Request, typename Response, typename Run>
grpc::ServerUnaryReactor* ServeUnary(grpc::CallbackServerContext* context, ServerMetrics* metrics,
                                     const GrpcMethod& method, const grpc::ByteBuffer& raw_request,
                                     grpc::ByteBuffer* raw_response, Run&& run) {
  GrpcCall call(metrics, method);
  call.Start(int64_t(raw_request.Length()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  RunUnary<Request, Response>(reactor, &call, raw_request, raw_response, std::forward<Run>(run));
  return reactor;
}

}  // namespace flashserve
