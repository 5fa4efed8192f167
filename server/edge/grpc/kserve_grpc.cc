#include "edge/grpc/kserve_grpc.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/kserve_shm_grpc.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/message_allocator.h"
#include "inference/open_inference_grpc.grpc.pb.h"
#include "runtime/shm_requests.h"

namespace flashserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

// ModelInfer's messages are ours, not gRPC's, so the handler may move the raw input bytes out of
// the request into the AttentionRequest instead of copying them. gRPC releases them when it has
// finished the call, response written: they also count the call for the shutdown drain.
class InferMessages final : public grpc::MessageHolder<ModelInferRequest, ModelInferResponse> {
 public:
  InferMessages() {
    set_request(&request_);
    set_response(&response_);
  }
  void Release() override { delete this; }

 private:
  ModelInferRequest request_;
  ModelInferResponse response_;
  LiveCall live_;
};

class InferAllocator final : public grpc::MessageAllocator<ModelInferRequest, ModelInferResponse> {
 public:
  grpc::MessageHolder<ModelInferRequest, ModelInferResponse>* AllocateMessages() override {
    return new InferMessages;
  }
};

// One ModelInfer in flight: the native request/response it becomes. Deleted by its done callback.
struct InferCall {
  explicit InferCall(ServerMetrics* metrics) : call(metrics, grpc_methods::kModelInfer) {}
  v1::AttentionRequest request;
  v1::AttentionResponse response;
  std::vector<kserve::OutputSpec> outputs;
  kserve::ShmParams shm_inputs[3];  // Q, K, V in a client's shared-memory region
  ShmLeases leases;                 // given back before the answer
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

class KServeGrpcService final : public inference::GRPCInferenceService::CallbackService {
 public:
  KServeGrpcService(AttentionRuntime* runtime, const kserve::KServeOptions& options)
      : runtime_(runtime) {
    model_.name = options.model_name;
    model_.server_version = options.server_version;
    for (kernels::DType dtype : runtime->limits().dtypes) {
      model_.dtypes.push_back(static_cast<v1::DType>(dtype));
    }
    SetMessageAllocatorFor_ModelInfer(&allocator_);
  }

  // Health: open without a token and not counted (edge/grpc/grpc_auth.h, grpc_call.h).
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* /*request*/,
                                       inference::ServerLiveResponse* response) override {
    response->set_live(runtime_->live());  // false once the backend is unusable (sticky fault)
    return FinishHealth(context);
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* /*request*/,
                                        inference::ServerReadyResponse* response) override {
    response->set_ready(runtime_->ready());
    return FinishHealth(context);
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override {
    GrpcCall call(runtime_->metrics(), grpc_methods::kModelReady);
    call.Start();
    absl::Status s = kserve::CheckModel(model_, request->name(), request->version());
    if (s.ok()) response->set_ready(runtime_->ready());
    return Finish(context, &call, s, *response);
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* /*request*/,
                                           inference::ServerMetadataResponse* response) override {
    GrpcCall call(runtime_->metrics(), grpc_methods::kServerMetadata);
    call.Start();
    response->set_name(model_.server_name);
    response->set_version(model_.server_version);
    for (const std::string& extension : kserve::Extensions()) response->add_extensions(extension);
    return Finish(context, &call, absl::OkStatus(), *response);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override {
    GrpcCall call(runtime_->metrics(), grpc_methods::kModelMetadata);
    call.Start();
    absl::Status s = kserve::CheckModel(model_, request->name(), request->version());
    if (s.ok()) kserve::FillGrpcModelMetadata(model_, response);
    return Finish(context, &call, s, *response);
  }

#define FLASHSERVE_SHM_CALL(Method, Work, ARGS)                                           \
  grpc::ServerUnaryReactor* Method(grpc::CallbackServerContext* context,                   \
                                   const inference::Method##Request* request,              \
                                   inference::Method##Response* response) override {       \
    GrpcCall call(runtime_->metrics(), grpc_methods::k##Method);                            \
    call.Start();                                                                           \
    return Finish(context, &call, kserve::Work ARGS, *response);                            \
  }
  // Triton's shared-memory extension (edge/grpc/kserve_shm_grpc.h).
  FLASHSERVE_SHM_CALL(SystemSharedMemoryStatus, SystemShmStatus, (*runtime_, *request, response))
  FLASHSERVE_SHM_CALL(SystemSharedMemoryRegister, SystemShmRegister, (*runtime_, *request))
  FLASHSERVE_SHM_CALL(SystemSharedMemoryUnregister, SystemShmUnregister, (*runtime_, *request))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryStatus, CudaShmStatus, (*runtime_, *request, response))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryRegister, CudaShmRegister, (*runtime_, *request))
  FLASHSERVE_SHM_CALL(CudaSharedMemoryUnregister, CudaShmUnregister, (*runtime_, *request))
#undef FLASHSERVE_SHM_CALL

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const ModelInferRequest* /*request*/,
                                       ModelInferResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    // The allocator made the messages: the request is ours to take the raw bytes from.
    ModelInferRequest* request =
        static_cast<grpc::MessageHolder<ModelInferRequest, ModelInferResponse>*>(
            context->GetRpcAllocatorState())
            ->request();
    auto* call_state = new InferCall(runtime_->metrics());
    call_state->call.Start(int64_t(request->ByteSizeLong()));
    call_state->received = call_state->call.started();
    call_state->id = request->id();
    call_state->call.set_request_id(request->id());

    auto done = [this, reactor, response, call_state](const absl::Status& status) {
      call_state->leases.clear();  // the output is in its region: the client may unregister now
      if (status.ok()) {
        kserve::AttentionToGrpcInfer(model_, call_state->id, call_state->outputs,
                                     &call_state->response, response);
        call_state->call.AddBytesOut(int64_t(response->ByteSizeLong()));
      }
      const grpc::Status finished = call_state->call.Finish(status);
      delete call_state;
      reactor->Finish(finished);
    };

    int64_t timeout_us = 0;
    absl::Status converted =
        kserve::CheckModel(model_, request->model_name(), request->model_version());
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
  static grpc::ServerUnaryReactor* FinishHealth(grpc::CallbackServerContext* context) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  // Ends a unary call with `status` (its response counted as sent when ok).
  static grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, GrpcCall* call,
                                          const absl::Status& status,
                                          const google::protobuf::MessageLite& response) {
    if (status.ok()) call->AddBytesOut(int64_t(response.ByteSizeLong()));
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(call->Finish(status));
    return reactor;
  }

  AttentionRuntime* const runtime_;
  kserve::ModelInfo model_;
  InferAllocator allocator_;
};

}  // namespace

std::unique_ptr<grpc::Service> CreateKServeGrpcService(AttentionRuntime* runtime,
                                                       const kserve::KServeOptions& options) {
  return std::make_unique<KServeGrpcService>(runtime, options);
}

}  // namespace flashserve
