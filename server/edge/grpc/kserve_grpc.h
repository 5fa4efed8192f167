// The KServe v2 / Open Inference Protocol gRPC service, inference.GRPCInferenceService
// (proto/inference/open_inference_grpc.proto), served on the gRPC edge's port beside
// flashserve.v1.AttentionService: ServerLive, ServerReady, ModelReady, ServerMetadata,
// ModelMetadata and ModelInfer (raw_input_contents / raw_output_contents).
#pragma once

#include <memory>

#include "edge/grpc/kserve_grpc_convert.h"
#include "grpcpp/impl/service_type.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

/// Thread-safe callback service; register it with GrpcEdge::Create's extra_services. It must
/// outlive the gRPC server, and `runtime` must outlive it. The bearer token is checked by the
/// edge for every service on its port (GrpcOptions::auth, edge/grpc/grpc_auth.h): every RPC but
/// ServerLive and ServerReady (health) needs it.
std::unique_ptr<grpc::Service> CreateKServeGrpcService(AttentionRuntime* runtime,
                                                       const kserve::KServeOptions& options);

}  // namespace flashserve
