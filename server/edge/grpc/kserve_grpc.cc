#include "edge/grpc/kserve_grpc.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/kserve_shm_grpc.h"
#include "edge/grpc/live_calls.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "inference/open_inference_grpc.grpc.pb.h"
#include "runtime/shm_requests.h"

namespace flashserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

// One ModelInfer in flight: the native request/response it becomes. Deleted by its done callback.
struct InferCall {
  explicit InferCall(ServerMetrics* metrics) : call(metrics, grpc_methods::kModelInfer) {}
  ModelInferRequest infer_request;  // parsed here: its raw input bytes are moved, not copied
  v1::AttentionRequest request;
  v1::AttentionResponse response;
  ModelInferResponse infer_response;
  std::vector<kserve::OutputSpec> outputs;
  kserve::ShmParams shm_inputs[3];  // Q, K, V in a client's shared-memory region
  ShmLeases leases;                 // given back before the answer
  std::shared_ptr<void> answer_bytes;  // --max_inflight_bytes: to the reactor with the answer
  std::string id;
  absl::Time received;
  GrpcCall call;  // metrics, failure log, status conversion
};

ShmReferences ShmReferencesOf(const InferCall& call) {
  ShmReferences refs;
  for (int i = 0; i < 3; ++i) {
    const kserve::ShmParams& p = call.shm_inputs[i];
    refs.inputs[i] = {p.region, p.offset, p.byte_size};
  }
  for (const kserve::OutputSpec& spec : call.outputs) {
    refs.outputs[spec.kind] = {spec.shm.region, spec.shm.offset, spec.shm.byte_size};
  }
  return refs;
}

// CheckWireObjects on a raw request: a parse that would hold many times its bytes is refused.
absl::Status CheckRawObjects(const grpc::ByteBuffer& raw,
                             const google::protobuf::Descriptor& type) {
  grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(&raw));  // reads only
  return kserve::CheckWireObjects(&reader, type);
}

// ServeUnary, with the request's objects counted before it is parsed (CheckRawObjects).
template <typename Request, typename Response, typename Run>
grpc::ServerUnaryReactor* ServeBounded(grpc::CallbackServerContext* context,
                                       ServerMetrics* metrics, const GrpcMethod& method,
                                       const grpc::ByteBuffer& raw_request,
                                       grpc::ByteBuffer* raw_response, Run&& run) {
  GrpcCall call(metrics, method);
  call.Start(int64_t(raw_request.Length()));
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  if (absl::Status s = CheckRawObjects(raw_request, *Request::descriptor()); !s.ok()) {
    FinishUnary(reactor, &call, s, Response(), raw_response);
    return reactor;
  }
  RunUnary<Request, Response>(reactor, &call, raw_request, raw_response, std::forward<Run>(run));
  return reactor;
}

using KServe = inference::GRPCInferenceService;
using KServeBase =
    Wrapped<KServe::Service, KServe::WithRawCallbackMethod_ServerLive,
            KServe::WithRawCallbackMethod_ServerReady, KServe::WithRawCallbackMethod_ModelReady,
            KServe::WithRawCallbackMethod_ServerMetadata,
            KServe::WithRawCallbackMethod_ModelMetadata, KServe::WithRawCallbackMethod_ModelInfer,
            KServe::WithRawCallbackMethod_SystemSharedMemoryStatus,
            KServe::WithRawCallbackMethod_SystemSharedMemoryRegister,
            KServe::WithRawCallbackMethod_SystemSharedMemoryUnregister,
            KServe::WithRawCallbackMethod_CudaSharedMemoryStatus,
            KServe::WithRawCallbackMethod_CudaSharedMemoryRegister,
            KServe::WithRawCallbackMethod_CudaSharedMemoryUnregister>;

// Health methods: open without a token and not counted (edge/grpc/grpc_auth.h, grpc_call.h); a
// request that does not parse is still answered INVALID_ARGUMENT and logged.
constexpr GrpcMethod kServerLive{"/inference.GRPCInferenceService/ServerLive", "ServerLive"};
constexpr GrpcMethod kServerReady{"/inference.GRPCInferenceService/ServerReady", "ServerReady"};

// Every method is raw (its bytes in and out): grpc_call.h says why.
class KServeGrpcService final : public KServeBase {
 public:
  using Raw = grpc::ByteBuffer;

  KServeGrpcService(AttentionRuntime* runtime, const kserve::KServeOptions& options)
      : runtime_(runtime) {
    model_.name = options.model_name;
    model_.server_version = options.server_version;
    model_.extensions = options.extensions;
    for (kernels::DType dtype : runtime->limits().dtypes) {
      model_.dtypes.push_back(static_cast<v1::DType>(dtype));
    }
  }

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context, const Raw* request,
                                       Raw* response) override {
    return ServeBounded<inference::ServerLiveRequest, inference::ServerLiveResponse>(
        context, nullptr, kServerLive, *request, response, [this](auto&, auto* live, GrpcCall*) {
          live->set_live(runtime_->live());  // false once the backend is unusable (sticky fault)
          return absl::OkStatus();
        });
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context, const Raw* request,
                                        Raw* response) override {
    return ServeBounded<inference::ServerReadyRequest, inference::ServerReadyResponse>(
        context, nullptr, kServerReady, *request, response, [this](auto&, auto* ready, GrpcCall*) {
          ready->set_ready(runtime_->ready());
          return absl::OkStatus();
        });
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context, const Raw* request,
                                       Raw* response) override {
    return Serve<inference::ModelReadyRequest, inference::ModelReadyResponse>(
        context, grpc_methods::kModelReady, *request, response,
        [this](const inference::ModelReadyRequest& asked, inference::ModelReadyResponse* ready) {
          absl::Status s = kserve::CheckModel(model_, asked.name(), asked.version());
          if (s.ok()) ready->set_ready(runtime_->ready());
          return s;
        });
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context, const Raw* request,
                                           Raw* response) override {
    return Serve<inference::ServerMetadataRequest, inference::ServerMetadataResponse>(
        context, grpc_methods::kServerMetadata, *request, response,
        [this](auto&, inference::ServerMetadataResponse* metadata) {
          metadata->set_name(model_.server_name);
          metadata->set_version(model_.server_version);
          for (const std::string& extension : model_.extensions) {
            metadata->add_extensions(extension);
          }
          return absl::OkStatus();
        });
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context, const Raw* request,
                                          Raw* response) override {
    return Serve<inference::ModelMetadataRequest, inference::ModelMetadataResponse>(
        context, grpc_methods::kModelMetadata, *request, response,
        [this](const inference::ModelMetadataRequest& asked,
               inference::ModelMetadataResponse* metadata) {
          absl::Status s = kserve::CheckModel(model_, asked.name(), asked.version());
          if (s.ok()) kserve::FillGrpcModelMetadata(model_, metadata);
          return s;
        });
  }

#define FLASHSERVE_SHM_CALL(Method, Work, ARGS)                                                    \
  grpc::ServerUnaryReactor* Method(grpc::CallbackServerContext* context, const Raw* raw,           \
                                   Raw* raw_response) override {                                   \
    return Serve<inference::Method##Request, inference::Method##Response>(                         \
        context, grpc_methods::k##Method, *raw, raw_response,                                      \
        [this](const inference::Method##Request& request, inference::Method##Response* response) { \
          return kserve::Work ARGS;                                                                \
        });                                                                                        \
  }
  // Triton's shared-memory extension (edge/grpc/kserve_shm_grpc.h).
  FLASHSERVE_SHM_CALL(SystemSharedMemoryStatus, SystemShmStatus, (*runtime_, request, response))
  FLASHSERVE_SHM_CALL(SystemSharedMemoryRegister, SystemShmRegister, (*runtime_, request))
  FLASHSERVE_SHM_CALL(SystemSharedMemoryUnregister, SystemShmUnregister, (*runtime_, request))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryStatus, CudaShmStatus, (*runtime_, request, response))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryRegister, CudaShmRegister, (*runtime_, request))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryUnregister, CudaShmUnregister, (*runtime_, request))
#undef FLASHSERVE_SHM_CALL

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context, const Raw* raw_request,
                                       Raw* raw_response) override {
    // Counts as a live call until gRPC has written the answer (live_calls.h).
    LiveUnaryReactor* reactor = new LiveUnaryReactor();
    auto* call_state = new InferCall(runtime_->metrics());
    call_state->call.Start(int64_t(raw_request->Length()));
    call_state->received = call_state->call.started();
    auto done = [this, reactor, context, raw_response, call_state](absl::Status status) {
      // The output is in its region: the client may unregister now.
      status = ReleaseShmLeases(std::move(status), &call_state->leases);
      if (status.ok()) {
        kserve::AttentionToGrpcInfer(model_, call_state->id, call_state->outputs,
                                     &call_state->response, &call_state->infer_response);
        status = SerializeAnswer(call_state->infer_response, raw_response);
        if (status.ok()) call_state->call.AddBytesOut(int64_t(raw_response->Length()));
      }
      const grpc::Status finished = call_state->call.Finish(status);
      std::shared_ptr<void> answer_bytes = std::move(call_state->answer_bytes);
      delete call_state;
      reactor->FinishAnswer(context, std::move(answer_bytes), finished);
    };
    ModelInferRequest* request = &call_state->infer_request;
    absl::Status converted = CheckRawObjects(*raw_request, *ModelInferRequest::descriptor());
    if (converted.ok()) converted = ParseRequest(*raw_request, request);
    if (!converted.ok()) {
      done(converted);
      return reactor;
    }
    call_state->id = request->id();
    call_state->call.set_request_id(request->id());

    int64_t timeout_us = 0;
    converted = kserve::CheckModel(model_, request->model_name(), request->model_version());
    if (converted.ok()) {
      converted = kserve::GrpcInferToAttention(request, &call_state->request, &call_state->outputs,
                                               &timeout_us, call_state->shm_inputs);
    }
    AttentionRuntime::Call call;
    call.request = &call_state->request;
    if (converted.ok()) {
      converted = AttachShm(*runtime_, ShmReferencesOf(*call_state), "", &call, &call_state->leases);
    }
    if (!converted.ok()) {
      done(converted);
      return reactor;
    }
    call.response = &call_state->response;
    call.answer_keeps_bytes = &call_state->answer_bytes;
    call.max_inline_answer_bytes = kMaxInlineAnswerBytes;
    call.received = call_state->received;
    call.deadline = ToAbslTime(context->deadline());
    if (timeout_us > 0) {
      call.deadline =
          std::min(call.deadline, call_state->received + absl::Microseconds(timeout_us));
    }
    call.cancelled = [context] { return context->IsCancelled(); };
    call.done = std::move(done);
    runtime_->Submit(std::move(call));
    return reactor;
  }

 private:
  // A counted method answered on gRPC's thread: `run(request, &response)`.
  template <typename Request, typename Response, typename Run>
  grpc::ServerUnaryReactor* Serve(grpc::CallbackServerContext* context, const GrpcMethod& method,
                                  const Raw& raw_request, Raw* raw_response, Run&& run) {
    return ServeBounded<Request, Response>(context, runtime_->metrics(), method, raw_request,
                                           raw_response,
                                           [&](const Request& request, Response* response,
                                               GrpcCall*) { return run(request, response); });
  }

  AttentionRuntime* const runtime_;
  kserve::ModelInfo model_;
};

}  // namespace

std::unique_ptr<grpc::Service> CreateKServeGrpcService(AttentionRuntime* runtime,
                                                       const kserve::KServeOptions& options) {
  return std::make_unique<KServeGrpcService>(runtime, options);
}

}  // namespace flashserve
