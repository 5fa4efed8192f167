// The gRPC edge: flashserve.v1.AttentionService (callback API), grpc.health.v1.Health and
// server reflection, on one listening port.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "memory/heap_retention.h"
#include "runtime/attention_runtime.h"

namespace grpc {
class Service;
}  // namespace grpc

namespace flashserve {

struct GrpcOptions {
  std::string host = "127.0.0.1";
  int port = 8001;  // 0: pick a free port
  int64_t max_request_bytes = int64_t{1} << 30;
  // gRPC resource quota for its buffers: -1 auto (sized from the host), 0 gRPC's default
  // (unbounded), > 0 bytes; edge/grpc/grpc_memory_quota.h has the rule.
  int64_t memory_quota_bytes = -1;
  // An answer the client has not taken this long after it was ready is dropped (the call is
  // cancelled: edge/grpc/answer_watch.h); until then its bytes count as in flight. 0: no limit.
  int answer_timeout_s = 120;
  std::string tls_cert_file, tls_key_file;  // both set: TLS
  // Set: every call but health needs the token, checked before its message is read
  // (edge/grpc/grpc_auth.h), on every service of the port.
  const BearerAuth* auth = nullptr;
  // Test hook (--enable_fault_injection): an Attention request whose request_id is
  // kInjectDeviceFaultRequestId faults its GPU instead of computing (sticky error path).
  bool enable_fault_injection = false;
  // > 0: small Attention requests run on a warm thread that polls this long between them.
  int64_t hot_lane_spin_us = 0;
  HeapRetention* heap_retention = nullptr;  // told each Attention request's size; may be null
};

/// What GetServerInfo reports beside the backend's capabilities.
struct ServerIdentity {
  std::string version;
  std::string build;
  int worker_threads = 0;
  int queue_capacity = 0;
  int64_t max_request_bytes = 0;
};

/// Thread-safe.
class GrpcEdge {
 public:
  /// extra_services (e.g. the KServe v2 GRPCInferenceService) are served on the same port;
  /// they must outlive the edge.
  static absl::StatusOr<std::unique_ptr<GrpcEdge>> Create(
      const GrpcOptions& options, AttentionRuntime* runtime, const ServerIdentity& identity,
      const std::vector<grpc::Service*>& extra_services = {});
  ~GrpcEdge();

  int port() const;
  /// Health status of "" and "flashserve.v1.AttentionService".
  void SetServing(bool serving);
  /// Waits until gRPC has finished every call that carries tensors (edge/grpc/live_calls.h: its
  /// response written), or until `deadline`; false if calls were left. A drained runtime has only
  /// handed the responses over.
  bool WaitForDataCalls(absl::Time deadline);
  /// Stops accepting RPCs; RPCs still running at `deadline` are cancelled.
  void Shutdown(absl::Time deadline);

 private:
  struct Impl;
  explicit GrpcEdge(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashserve
