// flashserve: exact attention as a service. Parses flags into options structs, wires the
// backend, scheduler and edges together, and handles SIGINT/SIGTERM with a graceful drain.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <ctime>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <malloc.h>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "autotune/tune_grid.h"
#include "common/auth.h"
#include "memory/heap_retention.h"
#include "common/logging.h"
#include "memory/receive_arena.h"
#include "common/version.h"
#include "edge/grpc/grpc_edge.h"
#include "edge/http/http_edge.h"
#include "edge/grpc/kserve_grpc.h"
#include "edge/http/kserve_rest.h"
#include "edge/grpc/stream_edge.h"
#include "metrics/metrics_http.h"
#include "metrics/server_metrics.h"
#include "runtime/attention_runtime.h"
#include "runtime/backend_factory.h"
#include "runtime/scheduler.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address the gRPC and HTTP servers bind to (0.0.0.0 for all interfaces)");
ABSL_FLAG(int, grpc_port, 8001,
          "gRPC port (AttentionService, health, reflection); 0 picks a free port");
ABSL_FLAG(int, http_port, 8000,
          "HTTP port (/v2/health/live, /v2/health/ready); 0 picks a free port");
ABSL_FLAG(int, metrics_port, 8002,
          "Prometheus metrics port (GET /metrics, text format 0.0.4); 0 picks a free port");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: auto (CUDA when a usable GPU exists, else CPU), cuda or cpu");
ABSL_FLAG(std::string, devices, "", "CUDA devices to use, e.g. \"0,1\"; empty: all visible");
ABSL_FLAG(int, streams_per_device, 4,
          "CUDA backend: streams (jobs in flight) per device, in [1, 64]; with 2+ one job's copies "
          "overlap another's kernel; 4 rather than 2 gave 16-64 concurrent small requests 10-30% "
          "more calls/s");
ABSL_FLAG(int, completion_spin_us, 200,
          "CUDA backend: how long a stream's completion thread polls for its job to finish before "
          "it sleeps (a sleeping wait wakes tens of us late, which dominates small requests; "
          "polling uses a core only while such a job runs); 0: always sleep, max 1000000");
ABSL_FLAG(int, copy_threads, 4,
          "Helper threads that copy a large request (>= 4 MiB) from gRPC's receive buffers into the "
          "backend's (pinned) buffers beside the gRPC thread, in [0, 64]; one thread copies ~6 GB/s "
          "into pinned memory. 0: the gRPC thread copies alone");
ABSL_FLAG(int64_t, hot_lane_spin_us, -1,
          "Attention requests under 4 MiB are processed on one thread that polls for the next "
          "request this long (microseconds) after each one, keeping its core warm (one core busy "
          "while requests keep coming; it sleeps after this long without one). gRPC otherwise runs "
          "each request on whichever of its threads is free, on a cold core: ~2x the CPU time of a "
          "small GPU request. -1: 1000 with the CUDA backend on a machine with >= 4 cores, else 0 "
          "(CPU-backend requests take milliseconds; on 2-3 cores a polling thread costs too "
          "much); 0: no such thread; at most 1000000");
ABSL_FLAG(bool, enable_fault_injection, false,
          "TEST ONLY: an Attention request whose request_id is "
          "\"flashserve-test:inject-device-fault\" faults its GPU (sticky CUDA error) instead of "
          "computing, to exercise the unhealthy-device path. Never enable in production");
ABSL_FLAG(int64_t, malloc_mmap_threshold_bytes, 128 << 10,
          "glibc malloc: allocations of at least this many bytes get their own mmap and go back "
          "to the system when freed. A fixed threshold stops glibc from raising it after large "
          "frees and then keeping tensor-sized buffers in per-thread arenas (RSS growth under "
          "mixed traffic; tests/soak/RESULTS.md); 0 keeps glibc's dynamic default");
ABSL_FLAG(int64_t, malloc_trim_threshold_bytes, int64_t{64} << 20,
          "glibc malloc: while Attention requests of >= 16 MiB keep arriving (one in the last 10 "
          "s), gRPC's receive buffers (256 KiB-4 MiB chunks) come from malloc's heap instead of "
          "their own mmaps, and free memory at the top of a heap goes back to the system only "
          "above this many bytes: the next big request reuses the pages instead of "
          "page-faulting them in again (50 MB requests ~10 ms faster). Costs up to this much per "
          "malloc arena while it lasts. 0 (or --malloc_mmap_threshold_bytes=0): never");
ABSL_FLAG(int, malloc_arena_max, 0,
          "glibc malloc: at most this many arenas (glibc's default, 0, is 8 per core). While "
          "--malloc_trim_threshold_bytes keeps big requests' receive buffers, each arena that "
          "received one keeps its own; fewer arenas bound that memory (and add lock contention)");
ABSL_FLAG(int64_t, device_pool_release_threshold_bytes, int64_t{4} << 30,
          "CUDA backend: freed device memory the stream-ordered pool (cudaMallocAsync) keeps "
          "mapped for reuse instead of returning it to the driver, per device");
ABSL_FLAG(int64_t, pinned_pool_bytes, int64_t{2} << 30,
          "Cap of the pool of request buffers (power-of-two size classes from 64 KiB, reused "
          "between requests): page-locked on the CUDA backend (a request that does not fit is "
          "served with slower pageable copies), heap memory on the CPU backend (no page faults "
          "of fresh buffers); 0 disables the pool");
ABSL_FLAG(int64_t, receive_arena_bytes, -1,
          "Memory for gRPC's socket read buffers (blocks of 64 KiB-4 MiB), so the native API's "
          "tensors can be copied to the GPU straight from where they arrived instead of being "
          "copied into pinned memory first: page-locked and allocated at startup on the CUDA "
          "backend; when it is full, buffers come from the heap and requests are copied as "
          "before. -1: 1 GiB on the CUDA backend, none on the CPU backend (where it only serves "
          "tests of the mechanism); 0: none");
ABSL_FLAG(int64_t, max_device_bytes_per_request, 0,
          "CUDA backend: a request needing more device memory (Q, K, V, O, LSE) gets "
          "RESOURCE_EXHAUSTED before any allocation; 0: no limit (the GPU's free memory is)");
ABSL_FLAG(std::string, autotune, "off",
          "Kernel autotuning (CUDA backend): off (use --tune_cache read-only, else heuristic "
          "defaults), background (unseen problem classes are served with the default while they "
          "are tuned off the request path), startup (tune the --tune_* grid before reporting "
          "ready, then background)");
ABSL_FLAG(std::string, tune_cache, "",
          "Autotuning cache file (JSON; written by the server and flashserve-tune); a cache from "
          "another GPU model or kernel build is ignored with a warning");
ABSL_FLAG(std::string, tune_dtypes, "bf16,fp16", "--autotune=startup grid: dtypes");
ABSL_FLAG(std::string, tune_head_dims, "64,128", "--autotune=startup grid: head dims");
ABSL_FLAG(std::string, tune_causal, "both", "--autotune=startup grid: yes, no or both");
ABSL_FLAG(std::string, tune_seqlens, "512,1024,2048,4096",
          "--autotune=startup grid: sequence lengths, q or q:k");
ABSL_FLAG(std::string, tune_gqa, "1", "--autotune=startup grid: GQA ratios heads_q/heads_kv");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "Largest serialized request accepted (bytes, at most 2147483647); larger ones get "
          "RESOURCE_EXHAUSTED before they are parsed (gRPC still receives them: bound that memory "
          "with --grpc_memory_quota_bytes)");
ABSL_FLAG(
    int64_t, max_inflight_bytes, int64_t{4} << 30,
    "Tensor bytes (inputs + outputs) of all accepted, unfinished requests; a request that would "
    "pass it gets RESOURCE_EXHAUSTED (one request alone is always admitted); 0: no limit");
ABSL_FLAG(
    int64_t, grpc_memory_quota_bytes, 0,
    "gRPC resource quota for its buffers (received messages included); 0 leaves gRPC's default");
ABSL_FLAG(
    std::string, tls_cert, "",
    "PEM certificate (chain) file: with --tls_key, gRPC, HTTP and metrics are served over TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key file for --tls_cert");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding a bearer token (>= 16 printable characters); when set, gRPC calls need "
          "metadata 'authorization: Bearer <token>' and HTTP/metrics requests the same header. "
          "Also read from $FLASHSERVE_AUTH_TOKEN when this flag is empty");
ABSL_FLAG(
    bool, auth_open_health, true,
    "With a token: leave /v2/health/* open (probes need no token); gRPC health is always open");
ABSL_FLAG(int64_t, max_tensor_elements, int64_t{1} << 28,
          "Largest element count of one tensor (Q, K or V); larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(
    int, queue_capacity, 64,
    "Requests that may wait for a worker; when full, new ones get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(int, worker_threads, 0, "CPU backend compute threads; 0 uses every core");
ABSL_FLAG(
    int, shutdown_grace_seconds, 10,
    "On SIGINT/SIGTERM: how long in-flight requests may take to finish before they are cancelled");
ABSL_FLAG(
    std::string, log_level, "info",
    "Log level: trace, debug, info, warn, error, critical, off (debug: one line per request)");
ABSL_FLAG(std::string, model_name, "attention",
          "Model name of the KServe v2 / Open Inference Protocol API (REST /v2/models/<name>, "
          "gRPC inference.GRPCInferenceService)");
ABSL_FLAG(int, stream_max_sessions, 16,
          "Striped streaming API (flashserve.v1.AttentionStreamService): open sessions at a time; "
          "each holds up to --max_request_bytes of tensors, all together up to "
          "--max_inflight_bytes");
ABSL_FLAG(int64_t, stream_session_timeout_ms, 60000,
          "Striped streaming API: a session idle for this long is dropped");
ABSL_FLAG(std::string, log_format, "text", "Log format: text, or json (one JSON object per line)");

namespace flashserve {
namespace {

absl::StatusOr<std::vector<int>> ParseDevices(const std::string& text) {
  std::vector<int> devices;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int device = 0;
    if (!absl::SimpleAtoi(part, &device) || device < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: bad device index \"", part, "\""));
    }
    devices.push_back(device);
  }
  return devices;
}

absl::Status CheckPort(const char* name, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " must be in [0, 65535], got ", port));
  }
  return absl::OkStatus();
}

int Serve() {
  if (absl::Status s =
          ConfigureLogging(absl::GetFlag(FLAGS_log_level), absl::GetFlag(FLAGS_log_format));
      !s.ok()) {
    spdlog::error("{}", std::string(s.message()));
    return 2;
  }

  for (auto [name, port] : {std::pair{"grpc_port", absl::GetFlag(FLAGS_grpc_port)},
                            std::pair{"http_port", absl::GetFlag(FLAGS_http_port)},
                            std::pair{"metrics_port", absl::GetFlag(FLAGS_metrics_port)}}) {
    if (absl::Status s = CheckPort(name, port); !s.ok()) {
      spdlog::error("{}", std::string(s.message()));
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_max_tensor_elements) < 1) {
    spdlog::error("--max_tensor_elements must be >= 1");
    return 2;
  }
  if (absl::GetFlag(FLAGS_shutdown_grace_seconds) < 0) {
    spdlog::error("--shutdown_grace_seconds must be >= 0");
    return 2;
  }
  if (const int64_t threshold = absl::GetFlag(FLAGS_malloc_mmap_threshold_bytes); threshold != 0) {
    // glibc caps M_MMAP_THRESHOLD at 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
    if (threshold < 0 || threshold > (int64_t{32} << 20)) {
      spdlog::error("--malloc_mmap_threshold_bytes must be in [0, 33554432], got {}", threshold);
      return 2;
    }
    if (mallopt(M_MMAP_THRESHOLD, int(threshold)) != 1) {
      // Another allocator in the process (a sanitizer's, jemalloc via LD_PRELOAD) ignores it.
      spdlog::warn("--malloc_mmap_threshold_bytes: the allocator refused mallopt(M_MMAP_THRESHOLD); "
                   "not glibc's malloc?");
    }
  }
  if (const int arenas = absl::GetFlag(FLAGS_malloc_arena_max); arenas != 0) {
    // Before any other thread allocates: arenas are made on a thread's first allocation.
    if (arenas < 0 || arenas > 1024) {
      spdlog::error("--malloc_arena_max must be in [0, 1024], got {}", arenas);
      return 2;
    }
    if (mallopt(M_ARENA_MAX, arenas) != 1) {
      spdlog::warn("--malloc_arena_max: the allocator refused mallopt(M_ARENA_MAX); not glibc's "
                   "malloc?");
    }
  }
  const int64_t trim_threshold = absl::GetFlag(FLAGS_malloc_trim_threshold_bytes);
  if (trim_threshold < 0 || trim_threshold > (int64_t{1} << 30)) {
    spdlog::error("--malloc_trim_threshold_bytes must be in [0, 1073741824], got {}",
                  trim_threshold);
    return 2;
  }
  HeapRetention heap_retention(trim_threshold, absl::GetFlag(FLAGS_malloc_mmap_threshold_bytes),
                               absl::Seconds(10));
  absl::StatusOr<std::vector<int>> devices = ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) {
    spdlog::error("{}", std::string(devices.status().message()));
    return 2;
  }

  BackendOptions backend_options;
  backend_options.kind = absl::GetFlag(FLAGS_backend);
  backend_options.cpu_threads = absl::GetFlag(FLAGS_worker_threads);
  backend_options.devices = *devices;
  backend_options.streams_per_device = absl::GetFlag(FLAGS_streams_per_device);
  backend_options.completion_spin_us = absl::GetFlag(FLAGS_completion_spin_us);
  backend_options.device_pool_release_threshold_bytes =
      absl::GetFlag(FLAGS_device_pool_release_threshold_bytes);
  backend_options.pinned_pool_bytes = absl::GetFlag(FLAGS_pinned_pool_bytes);
  backend_options.max_device_bytes_per_request = absl::GetFlag(FLAGS_max_device_bytes_per_request);
  const int64_t receive_arena_flag = absl::GetFlag(FLAGS_receive_arena_bytes);
  if (receive_arena_flag < -1) {
    spdlog::error("--receive_arena_bytes must be -1 (default), 0 or a byte count");
    return 2;
  }
  backend_options.receive_arena_bytes = receive_arena_flag < 0 ? int64_t{1} << 30 : receive_arena_flag;
  if (backend_options.streams_per_device < 1 || backend_options.streams_per_device > 64) {
    spdlog::error("--streams_per_device must be in [1, 64]");
    return 2;
  }
  if (backend_options.device_pool_release_threshold_bytes < 0 ||
      backend_options.pinned_pool_bytes < 0 || backend_options.max_device_bytes_per_request < 0) {
    spdlog::error(
        "--device_pool_release_threshold_bytes, --pinned_pool_bytes and "
        "--max_device_bytes_per_request must be >= 0");
    return 2;
  }
  backend_options.autotune = absl::GetFlag(FLAGS_autotune);
  backend_options.tune_cache_path = absl::GetFlag(FLAGS_tune_cache);
  if (backend_options.autotune == "startup") {
    absl::StatusOr<TuneGrid> grid =
        ParseTuneGrid(absl::GetFlag(FLAGS_tune_dtypes), absl::GetFlag(FLAGS_tune_head_dims),
                      absl::GetFlag(FLAGS_tune_causal), absl::GetFlag(FLAGS_tune_seqlens),
                      absl::GetFlag(FLAGS_tune_gqa));
    if (!grid.ok()) {
      spdlog::error("--tune_*: {}", std::string(grid.status().message()));
      return 2;
    }
    backend_options.startup_grid = *grid;
  }
  // The backend (and its tuning thread) exists before the metrics and outlives them, so
  // autotune events go through a relay the metrics attach to while they exist.
  auto autotune_events = std::make_shared<std::atomic<ServerMetrics*>>(nullptr);
  backend_options.on_autotune_event = [autotune_events](const char* event) {
    if (ServerMetrics* m = autotune_events->load()) m->RecordAutotune(event);
  };
  absl::StatusOr<CreatedBackend> created = CreateBackend(backend_options);
  if (!created.ok()) {
    spdlog::error("backend: {}", std::string(created.status().message()));
    return 1;
  }
  Backend& backend = *created->backend;
  if (backend.capabilities().name == "cpu" && receive_arena_flag > 0) {
    if (absl::Status s = ReceiveArena::InstallOnHeap(size_t(receive_arena_flag)); !s.ok()) {
      spdlog::error("--receive_arena_bytes: {}", std::string(s.message()));
      return 2;
    }
  }

  SchedulerOptions scheduler_options;
  scheduler_options.queue_capacity = absl::GetFlag(FLAGS_queue_capacity);
  scheduler_options.num_workers = created->scheduler_workers;
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Create(scheduler_options);
  if (!scheduler.ok()) {
    spdlog::error("--queue_capacity: {}", std::string(scheduler.status().message()));
    return 2;
  }

  const BackendCapabilities& caps = backend.capabilities();
  ValidationLimits limits;
  limits.max_tensor_elements = absl::GetFlag(FLAGS_max_tensor_elements);
  limits.dtypes = caps.dtypes;
  limits.head_dims = caps.head_dims;
  limits.max_head_dim = caps.max_head_dim;
  limits.backend_name = caps.name;
  ServerMetricsOptions metrics_options;
  metrics_options.version = kVersion;
  metrics_options.cuda = kCudaVersion;
  metrics_options.arch = kCudaArchs;
  metrics_options.methods.insert(metrics_options.methods.end(), {"ModelInfer", "KServeInfer"});
  ServerMetrics metrics(metrics_options);
  Scheduler* scheduler_ptr = scheduler->get();
  metrics.SetQueueDepthCallback([scheduler_ptr] { return double(scheduler_ptr->queue_depth()); });
  for (const DeviceDescription& device : caps.devices) {
    const int index = device.index;
    metrics.SetDevicePoolCallback(index, [&backend, index] {
      PoolBytes bytes;
      backend.DevicePoolBytes(index, &bytes.used, &bytes.reserved);
      return bytes;
    });
  }
  metrics.SetPinnedPoolCallback([&backend] {
    PoolBytes bytes;
    backend.PinnedPoolBytes(&bytes.used, &bytes.reserved);
    return bytes;
  });
  metrics.SetReceiveArenaCallback([] {
    ServerMetrics::ArenaBytes bytes;
    if (const ReceiveArena* arena = ReceiveArena::Installed()) {
      bytes.used = arena->used_bytes();
      bytes.peak = arena->peak_bytes();
      bytes.capacity = int64_t(arena->capacity());
    }
    return bytes;
  });
  autotune_events->store(&metrics);
  struct DetachMetrics {
    std::shared_ptr<std::atomic<ServerMetrics*>> relay;
    ~DetachMetrics() { relay->store(nullptr); }
  } detach_metrics{autotune_events};
  if (caps.name != "cuda" && backend_options.autotune != "off") {
    spdlog::warn("--autotune={} has no effect on the {} backend", backend_options.autotune,
                 caps.name);
  }
  if (absl::GetFlag(FLAGS_max_inflight_bytes) < 0) {
    spdlog::error("--max_inflight_bytes must be >= 0");
    return 2;
  }
  AttentionRuntime runtime(&backend, scheduler->get(), limits, &metrics,
                           absl::GetFlag(FLAGS_max_inflight_bytes));

  std::unique_ptr<BearerAuth> auth;
  {
    absl::StatusOr<std::unique_ptr<BearerAuth>> loaded;
    const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
    const char* token_env = std::getenv("FLASHSERVE_AUTH_TOKEN");
    if (!token_file.empty()) {
      loaded = BearerAuth::FromFile(token_file);
    } else if (token_env != nullptr && *token_env != '\0') {
      loaded = BearerAuth::FromToken(token_env);
    }
    if (!token_file.empty() || (token_env != nullptr && *token_env != '\0')) {
      if (!loaded.ok()) {
        spdlog::error("{}", std::string(loaded.status().message()));
        return 2;
      }
      auth = std::move(*loaded);
    }
  }

  ServerIdentity identity;
  identity.version = kVersion;
  identity.build = kBuildSummary;
  identity.worker_threads = absl::GetFlag(FLAGS_worker_threads) > 0
                                ? absl::GetFlag(FLAGS_worker_threads)
                                : int(std::thread::hardware_concurrency());
  identity.queue_capacity = scheduler_options.queue_capacity;
  identity.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);

  // The KServe v2 / Open Inference Protocol API on both edges; its gRPC service outlives them.
  if (absl::GetFlag(FLAGS_model_name).empty() ||
      absl::StrContains(absl::GetFlag(FLAGS_model_name), '/')) {
    spdlog::error("--model_name must be non-empty and without '/'");
    return 2;
  }
  kserve::KServeOptions kserve_options;
  kserve_options.model_name = absl::GetFlag(FLAGS_model_name);
  kserve_options.server_version = kVersion;
  kserve_options.max_request_bytes = identity.max_request_bytes;
  std::unique_ptr<grpc::Service> kserve_grpc =
      CreateKServeGrpcService(&runtime, kserve_options, auth.get());

  GrpcOptions grpc_options;
  grpc_options.host = absl::GetFlag(FLAGS_host);
  grpc_options.port = absl::GetFlag(FLAGS_grpc_port);
  grpc_options.max_request_bytes = identity.max_request_bytes;
  grpc_options.memory_quota_bytes = absl::GetFlag(FLAGS_grpc_memory_quota_bytes);
  grpc_options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  grpc_options.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  grpc_options.auth = auth.get();
  grpc_options.enable_fault_injection = absl::GetFlag(FLAGS_enable_fault_injection);
  grpc_options.copy_threads = absl::GetFlag(FLAGS_copy_threads);
  grpc_options.heap_retention = &heap_retention;
  if (const int64_t spin = absl::GetFlag(FLAGS_hot_lane_spin_us); spin < -1 || spin > 1000000) {
    spdlog::error("--hot_lane_spin_us must be in [-1, 1000000], got {}", spin);
    return 2;
  } else {
    const bool worth_a_core = caps.name == "cuda" && std::thread::hardware_concurrency() >= 4;
    grpc_options.hot_lane_spin_us = spin >= 0 ? spin : worth_a_core ? 1000 : 0;
  }
  StreamLimits stream_limits;
  stream_limits.max_sessions = std::max(1, absl::GetFlag(FLAGS_stream_max_sessions));
  stream_limits.max_session_bytes = identity.max_request_bytes;
  stream_limits.max_total_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  stream_limits.max_tensor_elements = limits.max_tensor_elements;
  stream_limits.idle_timeout =
      std::chrono::milliseconds(std::max<int64_t>(1, absl::GetFlag(FLAGS_stream_session_timeout_ms)));
  std::unique_ptr<grpc::Service> stream_grpc =
      CreateStreamService(&runtime, stream_limits, auth.get());
  absl::StatusOr<std::unique_ptr<GrpcEdge>> grpc_edge = GrpcEdge::Create(
      grpc_options, &runtime, identity, {kserve_grpc.get(), stream_grpc.get()});
  if (!grpc_edge.ok()) {
    spdlog::error("{}", std::string(grpc_edge.status().message()));
    return 1;
  }
  HttpOptions http_options;
  http_options.host = grpc_options.host;
  http_options.port = absl::GetFlag(FLAGS_http_port);
  http_options.max_request_bytes = identity.max_request_bytes;
  http_options.tls_cert_file = grpc_options.tls_cert_file;
  http_options.tls_key_file = grpc_options.tls_key_file;
  http_options.auth = auth.get();
  http_options.open_health = absl::GetFlag(FLAGS_auth_open_health);
  absl::StatusOr<std::unique_ptr<HttpEdge>> http_edge =
      HttpEdge::Create(http_options, &runtime, kserve_options);
  if (!http_edge.ok()) {
    spdlog::error("{}", std::string(http_edge.status().message()));
    return 1;
  }

  MetricsHttpOptions metrics_http_options;
  metrics_http_options.host = grpc_options.host;
  metrics_http_options.port = absl::GetFlag(FLAGS_metrics_port);
  metrics_http_options.tls_cert_file = grpc_options.tls_cert_file;
  metrics_http_options.tls_key_file = grpc_options.tls_key_file;
  metrics_http_options.auth = auth.get();
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_http =
      MetricsHttpServer::Create(metrics_http_options, &metrics);
  if (!metrics_http.ok()) {
    spdlog::error("{}", std::string(metrics_http.status().message()));
    return 1;
  }

  std::vector<std::string> device_names;
  for (const DeviceDescription& d : caps.devices) {
    device_names.push_back(
        absl::StrCat(d.index, ":", d.name, " (sm_", d.cc_major, d.cc_minor, ")"));
  }
  spdlog::info(
      "flashserve {} serving: backend={} ({}) devices=[{}] grpc={}:{} http={}:{} metrics={}:{} "
      "queue={} tls={} auth={}",
      kVersion, caps.name, created->reason, absl::StrJoin(device_names, ", "), grpc_options.host,
      (*grpc_edge)->port(), http_options.host, (*http_edge)->port(), metrics_http_options.host,
      (*metrics_http)->port(), scheduler_options.queue_capacity,
      grpc_options.tls_cert_file.empty() ? "off" : "on", auth ? "bearer" : "off");

  // Wait for SIGINT/SIGTERM (blocked in every thread; taken here synchronously).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  // Every second, gRPC health follows the runtime: a device fault (sticky CUDA error) turns it
  // NOT_SERVING, as /v2/health/ready turns 503.
  int signal_number = 0;
  bool serving = true;
  const timespec tick{1, 0};
  for (;;) {
    signal_number = sigtimedwait(&signals, nullptr, &tick);
    if (signal_number > 0) break;
    if (serving && !runtime.ready()) {
      serving = false;
      (*grpc_edge)->SetServing(false);
      spdlog::error("backend unhealthy: gRPC health NOT_SERVING, HTTP ready 503");
    }
  }

  const absl::Duration grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds));
  const absl::Time deadline = absl::Now() + grace;
  spdlog::info("{} received: draining (grace {}s)", strsignal(signal_number),
               absl::GetFlag(FLAGS_shutdown_grace_seconds));
  (*grpc_edge)->SetServing(false);
  runtime.StopAccepting();  // new requests: UNAVAILABLE
  // Native Attention calls are admitted when they start (edge/grpc/attention_call.h), so WaitIdle also
  // waits for requests still uploading; gRPC's Shutdown would cancel those. Then the answers
  // handed to gRPC -- native, KServe and striped downloads alike -- must still be written: a large
  // one to a slow reader can take seconds, and Shutdown's deadline would cut it off.
  const bool drained =
      runtime.WaitIdle(deadline) && (*grpc_edge)->WaitForDataCalls(deadline);
  if (!drained) spdlog::warn("grace period over with requests still running; cancelling them");
  (*grpc_edge)->Shutdown(drained ? absl::Now() + absl::Seconds(1) : absl::Now());
  spdlog::debug("shutdown: gRPC stopped");
  (*http_edge)->Stop();
  spdlog::debug("shutdown: HTTP stopped");
  (*metrics_http)->Stop();  // before the scheduler its queue-depth callback reads goes away
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace flashserve

int main(int argc, char** argv) {
  // Block the shutdown signals before any thread starts, so every thread inherits the mask
  // and only the main thread's sigwait sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "server/main.cc");
  };
  usage_config.version_string = [] {
    return absl::StrCat("flashserve ", flashserve::kVersion, "\n");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "exact attention over gRPC (port 8001) and HTTP (port 8000).\n"
      "Usage: flashserve [--flag=value ...]");
  // --help prints the flags and exits 0 (Abseil's own handling exits 1).
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-help" || arg == "-h") {
      absl::flags_internal::SetProgramInvocationName("flashserve");
      absl::flags_internal::FlagsHelp(std::cout, "server/main.cc",
                                      absl::flags_internal::HelpFormat::kHumanReadable,
                                      absl::ProgramUsageMessage());
      return 0;
    }
  }
  absl::ParseCommandLine(argc, argv);
  return flashserve::Serve();
}
