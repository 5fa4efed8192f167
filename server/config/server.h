// The assembled server: backend, scheduler, metrics, runtime and the three listeners (gRPC, HTTP,
// metrics), built from a ServerConfig, and its drain. main.cc only starts it, waits and drains.
#pragma once

#include <atomic>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "config/serve_loop.h"
#include "config/server_config.h"
#include "edge/grpc/grpc_edge.h"
#include "edge/grpc/kserve_grpc.h"
#include "edge/http/http_edge.h"
#include "edge/local/local_listener.h"
#include "memory/heap_retention.h"
#include "memory/parallel_copy.h"
#include "metrics/metrics_http.h"
#include "metrics/server_metrics.h"
#include "runtime/attention_runtime.h"
#include "runtime/backend_factory.h"
#include "runtime/scheduler.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

/// Main thread only (the objects it owns are thread-safe themselves).
class Server {
 public:
  /// Sets up logging and malloc (call before any other thread starts), creates everything and
  /// starts listening. INVALID_ARGUMENT: a setting or file was refused (exit kExitBadConfig);
  /// other errors: something could not start (exit kExitStartFailed). The config must be checked.
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerConfig& config);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Whether the process is worth keeping (AttentionRuntime::live).
  bool live() const { return runtime_->live(); }
  /// Waits for a shutdown signal or an unhealthy backend; on the latter turns gRPC health
  /// NOT_SERVING at once (HTTP ready and live follow the runtime by themselves).
  StopEvent WaitForStop();
  /// Ends serving within the grace period and stops every listener; false if requests were still
  /// running at its end (they are cancelled). After a signal new requests get UNAVAILABLE at once.
  /// After a backend fault the backend refuses them already, and the server stays up, not ready
  /// and not live, for the whole grace period (a signal cuts it short) so that load balancers
  /// and clients see why before the port closes.
  bool Drain(const StopEvent& stop);

 private:
  explicit Server(const ServerConfig& config) : config_(config) {}
  absl::Status StartBackend();     // heap retention, backend, receive arena, scheduler
  void StartMetrics();             // the metrics and the callbacks they read at scrape time
  absl::Status StartRuntime();     // runtime, the Sequences API's KV cache, bearer auth
  absl::Status StartGrpc();        // the gRPC edge with the KServe and striped services
  absl::Status StartScrape();      // the metrics port (bound before HTTP answers "ready")
  absl::Status StartHttp();        // the HTTP edge
  absl::Status StartLocal();       // the local socket (--local_socket), if configured
  void LogServing() const;

  const ServerConfig config_;
  // Declared in the order they are built, so they are destroyed in reverse: each outlives what
  // uses it. The backend (and its tuning thread) outlives the metrics, so autotune events reach
  // the metrics through a relay that is cleared before they go.
  std::shared_ptr<std::atomic<ServerMetrics*>> autotune_relay_;
  std::unique_ptr<HeapRetention> heap_retention_;
  CreatedBackend backend_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<ShmRegistry> shm_regions_;  // clients' shared memory; outlives the runtime
  std::unique_ptr<ParallelCopier> copier_;  // stages inputs the backend cannot read in place
  std::unique_ptr<AttentionRuntime> runtime_;
  std::unique_ptr<BearerAuth> auth_;
  std::unique_ptr<SequenceRuntime> sequences_;  // null without --kv_cache_bytes
  std::unique_ptr<grpc::Service> kserve_grpc_;  // served by grpc_edge_, so they outlive it
  std::unique_ptr<grpc::Service> stream_grpc_;
  std::unique_ptr<grpc::Service> sequences_grpc_;
  std::unique_ptr<GrpcEdge> grpc_edge_;
  std::unique_ptr<HttpEdge> http_edge_;
  std::unique_ptr<LocalListener> local_;  // null without --local_socket
  std::unique_ptr<MetricsHttpServer> metrics_http_;
};

}  // namespace flashserve
