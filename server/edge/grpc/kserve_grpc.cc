#include "edge/grpc/kserve_grpc.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "common/logging.h"
#include "edge/grpc/grpc_auth.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/message_allocator.h"
#include "inference/open_inference_grpc.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

using inference::ModelInferRequest;
using inference::ModelInferResponse;

constexpr const char kMethod[] = "ModelInfer";  // the `method` label of gRPC inferences

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
  v1::AttentionRequest request;
  v1::AttentionResponse response;
  std::vector<kserve::OutputSpec> outputs;
  std::string id;
  int64_t bytes_in = 0;
  absl::Time received;
};

class KServeGrpcService final : public inference::GRPCInferenceService::CallbackService {
 public:
  KServeGrpcService(AttentionRuntime* runtime, const kserve::KServeOptions& options,
                    const BearerAuth* auth)
      : runtime_(runtime), auth_(auth) {
    model_.name = options.model_name;
    model_.server_version = options.server_version;
    for (kernels::DType dtype : runtime->limits().dtypes) {
      model_.dtypes.push_back(static_cast<v1::DType>(dtype));
    }
    SetMessageAllocatorFor_ModelInfer(&allocator_);
  }

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* /*request*/,
                                       inference::ServerLiveResponse* response) override {
    response->set_live(true);
    return Finish(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* /*request*/,
                                        inference::ServerReadyResponse* response) override {
    response->set_ready(runtime_->ready());
    return Finish(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override {
    if (!GrpcCallAuthorized(auth_, context)) return Unauthenticated(context);
    absl::Status s = kserve::CheckModel(model_, request->name(), request->version());
    if (s.ok()) response->set_ready(runtime_->ready());
    return Finish(context, ToGrpcStatus(s));
  }

  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* /*request*/,
                                           inference::ServerMetadataResponse* response) override {
    if (!GrpcCallAuthorized(auth_, context)) return Unauthenticated(context);
    response->set_name(model_.server_name);
    response->set_version(model_.server_version);
    for (const std::string& extension : kserve::Extensions()) response->add_extensions(extension);
    return Finish(context, grpc::Status::OK);
  }

  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override {
    if (!GrpcCallAuthorized(auth_, context)) return Unauthenticated(context);
    absl::Status s = kserve::CheckModel(model_, request->name(), request->version());
    if (s.ok()) kserve::FillGrpcModelMetadata(model_, response);
    return Finish(context, ToGrpcStatus(s));
  }

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const ModelInferRequest* /*request*/,
                                       ModelInferResponse* response) override {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    ServerMetrics* metrics = runtime_->metrics();
    if (!GrpcCallAuthorized(auth_, context)) {
      if (metrics != nullptr) metrics->RecordRequest(kMethod, 16 /* UNAUTHENTICATED */, 0.0, 0, 0);
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticatedMessage));
      return reactor;
    }
    // The allocator made the messages: the request is ours to take the raw bytes from.
    ModelInferRequest* request =
        static_cast<grpc::MessageHolder<ModelInferRequest, ModelInferResponse>*>(
            context->GetRpcAllocatorState())
            ->request();
    auto* call_state = new InferCall;
    call_state->received = absl::Now();
    call_state->bytes_in = int64_t(request->ByteSizeLong());
    call_state->id = request->id();
    if (metrics != nullptr) metrics->InflightInc();

    auto done = [this, reactor, response, metrics, call_state](const absl::Status& status) {
      if (status.ok()) {
        kserve::AttentionToGrpcInfer(model_, call_state->id, call_state->outputs,
                                     &call_state->response, response);
      } else {
        spdlog::warn("{} failed: id=\"{}\" code={} message=\"{}\"", kMethod,
                     LogSafe(call_state->id), absl::StatusCodeToString(status.code()),
                     std::string(status.message()));
      }
      if (metrics != nullptr) {
        metrics->InflightDec();
        metrics->RecordRequest(kMethod, static_cast<int>(status.code()),
                               absl::ToDoubleSeconds(absl::Now() - call_state->received),
                               call_state->bytes_in,
                               status.ok() ? int64_t(response->ByteSizeLong()) : 0);
      }
      delete call_state;
      reactor->Finish(ToGrpcStatus(status));
    };

    int64_t timeout_us = 0;
    absl::Status converted =
        kserve::CheckModel(model_, request->model_name(), request->model_version());
    if (converted.ok()) {
      converted = kserve::GrpcInferToAttention(request, &call_state->request, &call_state->outputs,
                                               &timeout_us);
    }
    if (!converted.ok()) {
      done(converted);
      return reactor;
    }
    AttentionRuntime::Call call;
    call.request = &call_state->request;
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
  static grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context,
                                          const grpc::Status& status) {
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  }
  static grpc::ServerUnaryReactor* Unauthenticated(grpc::CallbackServerContext* context) {
    return Finish(context,
                  grpc::Status(grpc::StatusCode::UNAUTHENTICATED, kUnauthenticatedMessage));
  }

  AttentionRuntime* const runtime_;
  const BearerAuth* const auth_;
  kserve::ModelInfo model_;
  InferAllocator allocator_;
};

}  // namespace

std::unique_ptr<grpc::Service> CreateKServeGrpcService(AttentionRuntime* runtime,
                                                       const kserve::KServeOptions& options,
                                                       const BearerAuth* auth) {
  return std::make_unique<KServeGrpcService>(runtime, options, auth);
}

}  // namespace flashserve
