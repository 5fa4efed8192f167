// ServerConfig: everything the server is started from, one options struct per concern. Each
// field's default is written once: in the options struct of the layer that uses it (BackendOptions,
// SchedulerOptions, ValidationLimits, the edges' GrpcOptions, HttpOptions, StreamLimits, ...),
// which the structs here read, or here when only the server has it. Each struct's range checks
// are its Check(), whose message names the flag. server/config/flags.cc fills a ServerConfig
// from the flags; nothing
// below config/ reads a flag.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/validation.h"
#include "edge/grpc/grpc_edge.h"
#include "edge/grpc/stream_edge.h"
#include "edge/http/http_edge.h"
#include "edge/local/local_options.h"
#include "edge/kserve/kserve_model.h"
#include "memory/shm_regions.h"
#include "metrics/metrics_http.h"
#include "runtime/backend_options.h"
#include "runtime/scheduler.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

/// Listening addresses, TLS and bearer-token auth of the gRPC, HTTP and metrics ports.
struct NetworkOptions {
  std::string host = GrpcOptions{}.host;
  int grpc_port = GrpcOptions{}.port;  // 0 everywhere: pick a free port
  int http_port = HttpOptions{}.port;
  int metrics_port = MetricsHttpOptions{}.port;
  std::string tls_cert_file, tls_key_file;  // both set: TLS on every port
  // gRPC's resource quota for its buffers (received messages included). -1: sized from the host
  // by the gRPC edge; 0: gRPC's default (no bound).
  int64_t grpc_memory_quota_bytes = GrpcOptions{}.memory_quota_bytes;
  int answer_timeout_s = GrpcOptions{}.answer_timeout_s;  // 0: no limit
  std::string auth_token_file;  // set: calls need "authorization: Bearer <token>"
  std::string auth_token;       // used when auth_token_file is empty ($FLASHSERVE_AUTH_TOKEN)
  bool auth_token_from_env = false;  // $FLASHSERVE_AUTH_TOKEN is set (maybe empty: refused)
  bool auth_open_health = HttpOptions{}.open_health;  // /v2/health/* without a token

  absl::Status Check() const;
};

/// The HTTP and metrics ports against hostile clients (server/README.md, "HTTP edge"); the
/// defaults are the HTTP edge's own (HttpOptions).
struct HttpLimitsOptions {
  static constexpr int kMinHeaderBytes = 1 << 10;
  static constexpr int kMaxHeaderBytes = 1 << 20;
  // Of --http_max_json_bytes: a KServe JSON header needs room for its names and shapes (the HTTP
  // edge refuses less too).
  static constexpr int64_t kMinJsonBytes = 1 << 10;
  // Of each --http_*_timeout_s.
  static constexpr int kMaxTimeoutSeconds = 24 * 3600;

  int max_connections = HttpOptions{}.max_connections;  // per port
  int max_connections_per_ip = HttpOptions{}.max_connections_per_ip;  // 0: no cap
  int max_header_bytes = HttpOptions{}.max_header_bytes;
  int idle_timeout_s = HttpOptions{}.idle_timeout_s;
  int header_timeout_s = HttpOptions{}.header_timeout_s;
  int body_timeout_s = HttpOptions{}.body_timeout_s;
  int64_t min_body_bytes_per_s = HttpOptions{}.min_body_bytes_per_s;  // 0: no floor
  int64_t max_json_bytes = HttpOptions{}.max_json_bytes;
  int64_t max_receive_bytes = HttpOptions{}.max_receive_bytes;

  absl::Status Check() const;
};

/// glibc malloc tuning (memory/heap_retention.h says why; README "Server flags").
struct MallocOptions {
  int64_t mmap_threshold_bytes = int64_t{128} << 10;  // 0: glibc's dynamic default
  int64_t trim_threshold_bytes = int64_t{64} << 20;   // while retaining big requests; 0: never
  int arena_max = 0;                                  // 0: glibc's default (8 per core)
  absl::Duration retention_hold = absl::Seconds(10);  // retain this long after a big request

  absl::Status Check() const;
};

/// Host memory: the receive arena, the request-buffer pool, malloc.
struct MemoryOptions {
  static constexpr int64_t kAuto = -1;
  static constexpr int64_t kCudaReceiveArenaBytes = int64_t{1} << 30;  // what kAuto means on CUDA
  // kAuto: kCudaReceiveArenaBytes on CUDA, none on CPU; 0: none.
  int64_t receive_arena_bytes = kAuto;
  int64_t pinned_pool_bytes = kDefaultRequestPoolBytes;  // both backends' request-buffer pool
  MallocOptions malloc;
  ShmLimits shm;  // clients' shared-memory regions (--allow_client_shm, --shm_max_*)

  absl::Status Check() const;
  /// The arena size for a backend ("cuda" or "cpu"): kAuto resolved.
  int64_t ReceiveArenaBytesFor(const std::string& backend_name) const;
};

/// Threads the gRPC edge adds beside its own.
struct RequestThreadOptions {
  static constexpr int64_t kAuto = -1;
  int copy_threads = 4;  // helpers copying a large request; 0: none
  int64_t hot_lane_spin_us = kAuto;    // kAuto: 1000 on CUDA with >= 4 cores, else 0 (no lane)

  absl::Status Check() const;
  int64_t HotLaneSpinUsFor(const std::string& backend_name, unsigned cores) const;
};

/// Size limits of requests. validation.max_tensor_elements has its default in api/validation.h.
struct LimitsOptions {
  // Q, K, V, O and LSE of elements this large, at 4 bytes each, stay far inside int64 (2^40 * 20
  // bytes < 2^45), so no size computed from a valid shape can overflow.
  static constexpr int64_t kMaxTensorElementsBound = int64_t{1} << 40;
  ValidationLimits validation;
  int64_t max_request_bytes = GrpcOptions{}.max_request_bytes;  // at most INT32_MAX (gRPC's limit)
  int64_t max_inflight_bytes = int64_t{4} << 30;  // 0: no limit

  absl::Status Check() const;
};

/// The striped streaming API (flashserve.v1.AttentionStreamService).
struct StreamOptions {
  int max_sessions = StreamLimits{}.max_sessions;
  int64_t session_timeout_ms = StreamLimits{}.idle_timeout.count();

  absl::Status Check() const;
};

/// The KServe v2 / Open Inference Protocol model both edges present.
struct ModelOptions {
  // The name is a path segment of /v2/models/<name>/versions/1/infer (the HTTP listener answers
  // 414 to a path over kMaxPathBytes, 2048), a metric label and a log field: 256 bytes keep that
  // route far inside the limit and are more than model names use.
  static constexpr size_t kMaxNameBytes = 256;
  std::string model_name = kserve::KServeOptions{}.model_name;

  absl::Status Check() const;
};

struct LogOptions {
  std::string level = "info";   // trace, debug, info, warn, error, critical, off
  std::string format = "text";  // text or json

  absl::Status Check() const;
};

/// The process's end. Exit codes: kExitOk after a drain on SIGINT/SIGTERM; kExitBadConfig for a
/// refused flag or file; kExitStartFailed when a listener or the backend cannot start;
/// kExitBackendUnhealthy after a sticky device fault (the process drains and exits so that its
/// supervisor restarts it with a fresh CUDA context).
struct ShutdownOptions {
  static constexpr int kExitOk = 0;
  static constexpr int kExitStartFailed = 1;
  static constexpr int kExitBadConfig = 2;
  static constexpr int kExitBackendUnhealthy = 3;
  // The shutdown may outlast grace_seconds by this long before the process exits with
  // kExitBackendUnhealthy regardless (ExitIfShutdownOutlasts): only a device that never completes
  // a launch holds it that long.
  static constexpr int kShutdownOverrunSeconds = 20;
  int grace_seconds = 10;  // in-flight requests may finish for this long, then are cancelled

  absl::Status Check() const;
};

struct TestHookOptions {
  bool enable_fault_injection = false;  // see --enable_fault_injection; never in production
};

struct ServerConfig {
  // An explicit --grpc_memory_quota_bytes is at least --max_request_bytes + this: one request of
  // the largest size plus room for the transport's own buffers (gRPC 1.51, CPU backend: at 256 KiB
  // no call got through, "Buffers full"; at 1 MiB calls up to --max_request_bytes=1MiB did). The
  // auto quota keeps more (+64 MiB); the margin is small so that a quota can still stop a message
  // over --max_request_bytes from being buffered whole (tests/python/test_bad_input_matrix.py).
  static constexpr int64_t kMinGrpcMemoryQuotaHeadroom = int64_t{4} << 20;
  NetworkOptions network;
  HttpLimitsOptions http;
  LocalOptions local;  // the local socket (--local_*); its auth is set when the server starts
  MemoryOptions memory;
  BackendOptions backend;  // its pool sizes are memory.pinned_pool_bytes (ResolvedBackend)
  SchedulerOptions scheduler;
  LimitsOptions limits;
  RequestThreadOptions request_threads;
  StreamOptions stream;
  SequenceRuntimeOptions sequences;  // the Sequences API's KV cache; capacity 0: off
  ModelOptions model;
  LogOptions log;
  ShutdownOptions shutdown;
  TestHookOptions test_hooks;

  /// Every struct's Check, in the order above, then the checks across structs: the first refusal.
  absl::Status Check() const;
  /// `backend` with both backends' request-buffer pools set to memory.pinned_pool_bytes.
  BackendOptions ResolvedBackend() const;
};

}  // namespace flashserve
