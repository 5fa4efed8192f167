// The native Attention method, served through gRPC's callback *generic* API so a call is seen when
// it starts, not when its (possibly GiB) request has arrived: it is admitted at once, so the
// shutdown drain waits for requests still uploading instead of gRPC cancelling them, and calls that
// start while draining are refused with UNAVAILABLE before their bytes are read. The wire format is
// unary (one request message, one response); only the server-side handler is streaming-shaped.
//
// Metrics, the failure log line and the status conversion are the call's GrpcCall
// (edge/grpc/grpc_call.h).
//
// Zero copy: the request is parsed from gRPC's receive slices (server/api/request_wire.h), its Q/K/V
// copied once into the backend's (pinned) IoBuffers, and O/LSE are sent as slices that point into
// those buffers (server/api/response_wire.h).
#pragma once

#include <memory>
#include <string_view>

#include "edge/grpc/hot_lane.h"
#include "grpcpp/generic/async_generic_service.h"
#include "memory/heap_retention.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

// With AttentionCallOptions::fault_injection, a request with one of these request_ids faults its
// GPU, hangs as a launch the device never completes, or has a CUDA call refused (InjectedFault).
inline constexpr char kInjectDeviceFaultRequestId[] = "flashserve-test:inject-device-fault";
inline constexpr char kInjectDeviceHangRequestId[] = "flashserve-test:inject-device-hang";
inline constexpr char kInjectLaunchErrorRequestId[] = "flashserve-test:inject-launch-error";

inline InjectedFault InjectedFaultFor(std::string_view request_id) {
  if (request_id == kInjectDeviceFaultRequestId) return InjectedFault::kDeviceFault;
  if (request_id == kInjectDeviceHangRequestId) return InjectedFault::kDeviceHang;
  if (request_id == kInjectLaunchErrorRequestId) return InjectedFault::kLaunchError;
  return InjectedFault::kNone;
}

// The bearer token is checked before a call reaches the router (edge/grpc/grpc_auth.h).
struct AttentionCallOptions {
  bool fault_injection = false;  // honour the kInject*RequestIds (tests only)
  // > 0: requests under 4 MiB are processed on a HotLane that polls this long between them
  // (edge/grpc/hot_lane.h); 0: on the gRPC thread that received them.
  int64_t hot_lane_spin_us = 0;
  HeapRetention* heap_retention = nullptr;  // told each request's size; may be null
};

/// Routes grpc_methods::kAttention (edge/grpc/grpc_call.h) to its reactor; every other
/// unregistered method gets UNIMPLEMENTED.
/// Register with ServerBuilder::RegisterCallbackGenericService; it must outlive the server.
class AttentionRouter final : public grpc::CallbackGenericService {
 public:
  AttentionRouter(AttentionRuntime* runtime, const AttentionCallOptions& options);
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;

 private:
  AttentionRuntime* const runtime_;
  const AttentionCallOptions options_;
  std::unique_ptr<HotLane> hot_lane_;
};

}  // namespace flashserve
