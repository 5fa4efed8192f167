#include "config/server.h"

#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/process_health.h"
#include "common/version.h"
#include "config/host_memory.h"
#include "config/serve_loop.h"
#include "edge/grpc/sequences_service.h"
#include "edge/grpc/stream_edge.h"
#include "edge/local/local_methods.h"
#include "memory/receive_arena.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

kserve::KServeOptions KServeOptionsFor(const ServerConfig& config, std::string_view backend) {
  kserve::KServeOptions kserve;
  kserve.model_name = config.model.model_name;
  kserve.server_version = kVersion;
  kserve.extensions = kserve::Extensions(config.memory.shm.allow, backend == "cuda");
  kserve.max_request_bytes = config.limits.max_request_bytes;
  return kserve;
}

// The bearer token of --auth_token_file, else of $FLASHSERVE_AUTH_TOKEN; null: no auth.
absl::StatusOr<std::unique_ptr<BearerAuth>> LoadAuth(const NetworkOptions& network) {
  absl::StatusOr<std::unique_ptr<BearerAuth>> auth;
  if (!network.auth_token_file.empty()) {
    auth = BearerAuth::FromFile(network.auth_token_file);
  } else if (network.auth_token_from_env && network.auth_token.empty()) {
    // A Kubernetes secret that resolved to nothing: serving without a token would be a silent "off".
    return absl::InvalidArgumentError(
        "FLASHSERVE_AUTH_TOKEN is set but empty (unset it to serve without a token)");
  } else if (!network.auth_token.empty()) {
    auth = BearerAuth::FromToken(network.auth_token);
  } else {
    return std::unique_ptr<BearerAuth>();
  }
  if (!auth.ok()) return absl::InvalidArgumentError(auth.status().message());
  return auth;
}

// Binds a socket to each address in turn (SO_REUSEADDR when `reuse`, as gRPC's listener sets: a
// connection in TIME_WAIT does not hold the port) and closes it: each try's errno, up to the
// first that bound (0).
std::vector<int> TryBinds(const addrinfo* found, bool reuse) {
  std::vector<int> errors;
  for (const addrinfo* a = found; a != nullptr && (errors.empty() || errors.back() != 0);
       a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    const int one = 1;
    if (fd >= 0 && reuse) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    errors.push_back(fd >= 0 && bind(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno);
    if (fd >= 0) close(fd);
  }
  return errors;
}

// When gRPC cannot listen: whether --host's value is why -- a name that does not resolve, or an
// address this machine has not (or of a family it lacks) -- as INVALID_ARGUMENT naming the flag
// (exit 2). OK otherwise: a port in use, or no file descriptors, is the environment's (exit 1).
absl::Status CheckListenHost(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int e = getaddrinfo(host.c_str(), nullptr, &hints, &found); e != 0) {
    // A resolver that is down for now (EAI_AGAIN, ...) is the environment's.
    if (e != EAI_NONAME && e != EAI_NODATA && e != EAI_ADDRFAMILY && e != EAI_FAIL) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("--host=", host, ": cannot resolve it: ", gai_strerror(e)));
  }
  const std::vector<int> errors = TryBinds(found, /*reuse=*/false);
  freeaddrinfo(found);
  int refused = 0;  // errno of a bind that refused the address itself
  for (const int e : errors) {
    // Bound, or not the address's fault (a port in use...): leave gRPC's error as it is.
    if (e != EADDRNOTAVAIL && e != EAFNOSUPPORT) return absl::OkStatus();
    if (refused == 0) refused = e;
  }
  if (refused == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--host=", host,
                                                 ": cannot listen on it: ", std::strerror(refused),
                                                 " (not an address of this machine?)"));
}

// Up to the hard limit (at most 2^20): every connection is a descriptor, and when they run out
// gRPC's listener stops for good (common/process_health.h); services often start at a soft 1024.
void RaiseOpenFileLimit() {
  constexpr rlim_t kMost = rlim_t{1} << 20;
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  rlimit raised = limit;
  raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? kMost : std::min(limit.rlim_max, kMost);
  if (raised.rlim_cur > limit.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) == 0) {
    spdlog::debug("open-file limit raised from {} to {}", limit.rlim_cur, raised.rlim_cur);
  }
}

// Whether a listening socket could bind host:port now (port 0: always).
bool PortIsFree(const std::string& host, int port) {
  if (port == 0) return true;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  const std::vector<int> errors = TryBinds(found, /*reuse=*/true);
  freeaddrinfo(found);
  return !errors.empty() && errors.back() == 0;
}

// TEST ONLY, and only with --enable_fault_injection: $FLASHSERVE_TEST_HOLD_STARTUP_MS holds the
// start that long with the backend, scheduler and gRPC threads running, deaf to signals as a
// hanging DNS lookup, GPU initialisation or bind is, so that tests/python/test_startup_signals.py
// can signal a startup in progress deterministically. Unset (the default): nothing.
void HoldStartupForTest(const TestHookOptions& hooks) {
  const char* value = std::getenv("FLASHSERVE_TEST_HOLD_STARTUP_MS");
  if (!hooks.enable_fault_injection || value == nullptr) return;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(value, &ms) || ms <= 0) {
    spdlog::warn("FLASHSERVE_TEST_HOLD_STARTUP_MS={}: not a positive number of ms; ignored", value);
    return;
  }
  spdlog::warn("TEST ONLY: holding the start for {} ms (FLASHSERVE_TEST_HOLD_STARTUP_MS)", ms);
  absl::SleepFor(absl::Milliseconds(ms));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerConfig& config) {
  if (absl::Status s = ConfigureLogging(config.log.level, config.log.format); !s.ok()) {
    return absl::InvalidArgumentError(s.message());
  }
  ApplyMallocOptions(config.memory.malloc);  // before any thread: arenas are made per thread
  RaiseOpenFileLimit();
  auto server = std::unique_ptr<Server>(new Server(config));
  if (absl::Status s = server->StartBackend(); !s.ok()) return s;
  server->StartMetrics();
  if (absl::Status s = server->StartRuntime(); !s.ok()) return s;
  // The local socket first: the health answers (gRPC, HTTP) say ready only once every listener is
  // bound (a local socket path that cannot be bound exits 2 without a moment of "ready"). gRPC
  // next (its refusals name --host and the TLS flags), then the metrics port before the HTTP edge:
  // a scrape right after HTTP says "ready" finds it listening.
  if (absl::Status s = server->StartLocal(); !s.ok()) return s;
  if (absl::Status s = server->StartGrpc(); !s.ok()) return s;
  HoldStartupForTest(config.test_hooks);
  if (absl::Status s = server->StartScrape(); !s.ok()) return s;
  if (absl::Status s = server->StartHttp(); !s.ok()) return s;
  server->LogServing();
  return server;
}

Server::~Server() {
  if (autotune_relay_ != nullptr) autotune_relay_->store(nullptr);
}

absl::Status Server::StartBackend() {
  const MallocOptions& malloc = config_.memory.malloc;
  heap_retention_ = std::make_unique<HeapRetention>(
      malloc.trim_threshold_bytes, malloc.mmap_threshold_bytes, malloc.retention_hold);
  BackendOptions backend_options = config_.ResolvedBackend();
  autotune_relay_ = std::make_shared<std::atomic<ServerMetrics*>>(nullptr);
  backend_options.cuda.on_autotune_event = [relay = autotune_relay_](const char* event) {
    if (ServerMetrics* metrics = relay->load()) metrics->RecordAutotune(event);
  };
  // A shutdown signal during startup tuning (minutes) ends the start (main exits 0; the
  // StartupSignalWatch ends the process itself if the class in progress takes too long).
  backend_options.cuda.stop_requested = [] { return StartupStopRequested(); };
  absl::StatusOr<CreatedBackend> created = CreateBackend(backend_options);
  if (!created.ok()) {
    return absl::Status(created.status().code(),
                        absl::StrCat("backend: ", created.status().message()));
  }
  backend_ = *std::move(created);
  const std::string& name = backend_.backend->capabilities().name;
  if (name != "cuda" && backend_options.cuda.autotune != "off") {
    spdlog::warn("--autotune={} has no effect on the {} backend", backend_options.cuda.autotune,
                 name);
  }
  if (absl::Status s = InstallReceiveArena(config_.memory, name); !s.ok()) return s;
  SchedulerOptions scheduler_options = config_.scheduler;
  scheduler_options.num_workers = backend_.scheduler_workers;
  absl::StatusOr<std::unique_ptr<Scheduler>> scheduler = Scheduler::Create(scheduler_options);
  if (!scheduler.ok()) return scheduler.status();
  scheduler_ = *std::move(scheduler);
  return absl::OkStatus();
}

void Server::StartMetrics() {
  ServerMetricsOptions options;
  options.version = kVersion;
  options.cuda = kCudaVersion;
  options.arch = kCudaArchs;
  options.methods.insert(options.methods.end(), {"ModelInfer", "KServeInfer"});
  if (!config_.local.socket_path.empty()) {
    for (std::string& label : LocalMethodLabels()) options.methods.push_back(std::move(label));
  }
  metrics_ = std::make_unique<ServerMetrics>(options);
  Scheduler* scheduler = scheduler_.get();
  metrics_->SetQueueDepthCallback([scheduler] { return double(scheduler->queue_depth()); });
  metrics_->SetQueueCapacity(config_.scheduler.queue_capacity);
  Backend* backend = backend_.backend.get();
  metrics_->SetBackendHealthyCallback([backend] { return backend->healthy(); });
  for (const DeviceDescription& device : backend->capabilities().devices) {
    const int index = device.index;
    metrics_->SetDevicePoolCallback(index, [backend, index] {
      PoolBytes bytes;
      backend->DevicePoolBytes(index, &bytes.used, &bytes.reserved);
      return bytes;
    });
  }
  metrics_->SetPinnedPoolCallback([backend] {
    PoolBytes bytes;
    backend->PinnedPoolBytes(&bytes.used, &bytes.reserved);
    return bytes;
  });
  metrics_->SetReceiveArenaCallback([] {
    ServerMetrics::ArenaBytes bytes;
    if (const ReceiveArena* arena = ReceiveArena::Installed()) {
      bytes.used = arena->used_bytes();
      bytes.peak = arena->peak_bytes();
      bytes.capacity = int64_t(arena->capacity());
    }
    return bytes;
  });
  autotune_relay_->store(metrics_.get());
}

absl::Status Server::StartRuntime() {
  const BackendCapabilities& caps = backend_.backend->capabilities();
  ValidationLimits limits = config_.limits.validation;
  limits.dtypes = caps.dtypes;
  limits.head_dims = caps.head_dims;
  limits.max_head_dim = caps.max_head_dim;
  limits.max_batch_and_heads = caps.max_batch_and_heads;
  limits.backend_name = caps.name;
  copier_ = std::make_unique<ParallelCopier>(config_.request_threads.copy_threads);
  runtime_ = std::make_unique<AttentionRuntime>(backend_.backend.get(), scheduler_.get(), limits,
                                                metrics_.get(), config_.limits.max_inflight_bytes,
                                                copier_.get());
  shm_regions_ = std::make_unique<ShmRegistry>(config_.memory.shm,
                                               backend_.backend->shm_device_access());
  runtime_->set_shm_regions(shm_regions_.get());
  if (config_.sequences.cache.capacity_bytes > 0) {
    absl::StatusOr<std::unique_ptr<SequenceRuntime>> sequences = SequenceRuntime::Create(
        config_.sequences, backend_.backend.get(), scheduler_.get(), metrics_.get());
    if (!sequences.ok()) return sequences.status();
    sequences_ = *std::move(sequences);
  }
  absl::StatusOr<std::unique_ptr<BearerAuth>> auth = LoadAuth(config_.network);
  if (!auth.ok()) return auth.status();
  auth_ = *std::move(auth);
  return absl::OkStatus();
}

absl::Status Server::StartGrpc() {
  const NetworkOptions& network = config_.network;
  const std::string& backend_name = backend_.backend->capabilities().name;
  // The bearer token is checked by the gRPC edge in front of every service (edge/grpc/grpc_auth.h).
  kserve_grpc_ = CreateKServeGrpcService(
      runtime_.get(), KServeOptionsFor(config_, backend_.backend->capabilities().name));
  StreamLimits stream;
  stream.max_sessions = config_.stream.max_sessions;
  stream.max_session_bytes = config_.limits.max_request_bytes;
  stream.max_total_bytes = config_.limits.max_inflight_bytes;
  stream.idle_timeout = std::chrono::milliseconds(config_.stream.session_timeout_ms);
  stream_grpc_ = CreateStreamService(runtime_.get(), stream);
  sequences_grpc_ = CreateSequencesService(runtime_.get(), sequences_.get(), heap_retention_.get());

  GrpcOptions grpc;
  grpc.host = network.host;
  grpc.port = network.grpc_port;
  grpc.max_request_bytes = config_.limits.max_request_bytes;
  grpc.memory_quota_bytes = network.grpc_memory_quota_bytes;
  grpc.answer_timeout_s = network.answer_timeout_s;
  grpc.tls_cert_file = network.tls_cert_file;
  grpc.tls_key_file = network.tls_key_file;
  grpc.auth = auth_.get();
  grpc.enable_fault_injection = config_.test_hooks.enable_fault_injection;
  grpc.hot_lane_spin_us =
      config_.request_threads.HotLaneSpinUsFor(backend_name, std::thread::hardware_concurrency());
  grpc.heap_retention = heap_retention_.get();
  ServerIdentity identity;
  identity.version = kVersion;
  identity.build = kBuildSummary;
  const int cpu_threads = config_.backend.cpu.num_threads;
  identity.worker_threads =
      cpu_threads > 0 ? cpu_threads : int(std::thread::hardware_concurrency());
  identity.queue_capacity = config_.scheduler.queue_capacity;
  identity.max_request_bytes = config_.limits.max_request_bytes;
  absl::StatusOr<std::unique_ptr<GrpcEdge>> edge = GrpcEdge::Create(
      grpc, runtime_.get(), identity,
      {kserve_grpc_.get(), stream_grpc_.get(), sequences_grpc_.get()});
  if (!edge.ok()) {
    if (edge.status().code() != absl::StatusCode::kUnavailable) return edge.status();
    if (absl::Status host = CheckListenHost(network.host); !host.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(edge.status().message(), ": ", host.message()));
    }
    if (!network.tls_cert_file.empty() && PortIsFree(network.host, network.grpc_port)) {
      // The port was not why: gRPC refused the certificate or key (logged above), which read as
      // a port conflict and exited 1.
      return absl::InvalidArgumentError(absl::StrCat(
          edge.status().message(),
          ": the port is free, so --tls_cert / --tls_key are why: a PEM "
          "certificate and the unencrypted PEM private key that matches it are needed"));
    }
    return edge.status();
  }
  grpc_edge_ = *std::move(edge);
  return absl::OkStatus();
}

absl::Status Server::StartHttp() {
  const NetworkOptions& network = config_.network;
  const HttpLimitsOptions& limits = config_.http;
  HttpOptions http;
  http.host = network.host;
  http.port = network.http_port;
  http.max_request_bytes = config_.limits.max_request_bytes;
  http.tls_cert_file = network.tls_cert_file;
  http.tls_key_file = network.tls_key_file;
  http.auth = auth_.get();
  http.open_health = network.auth_open_health;
  http.max_connections = limits.max_connections;
  http.max_connections_per_ip = limits.max_connections_per_ip;
  http.max_header_bytes = limits.max_header_bytes;
  http.idle_timeout_s = limits.idle_timeout_s;
  http.header_timeout_s = limits.header_timeout_s;
  http.body_timeout_s = limits.body_timeout_s;
  http.answer_timeout_s = network.answer_timeout_s;
  http.min_body_bytes_per_s = limits.min_body_bytes_per_s;
  http.max_json_bytes = limits.max_json_bytes;
  http.max_receive_bytes = limits.max_receive_bytes;
  absl::StatusOr<std::unique_ptr<HttpEdge>> edge = HttpEdge::Create(
      http, runtime_.get(), KServeOptionsFor(config_, backend_.backend->capabilities().name));
  if (!edge.ok()) return edge.status();
  http_edge_ = *std::move(edge);
  return absl::OkStatus();
}

absl::Status Server::StartScrape() {
  const NetworkOptions& network = config_.network;
  const HttpLimitsOptions& limits = config_.http;
  MetricsHttpOptions scrape;
  scrape.host = network.host;
  scrape.port = network.metrics_port;
  scrape.tls_cert_file = network.tls_cert_file;
  scrape.tls_key_file = network.tls_key_file;
  scrape.auth = auth_.get();
  scrape.max_connections = limits.max_connections;
  scrape.max_connections_per_ip = limits.max_connections_per_ip;
  scrape.max_header_bytes = limits.max_header_bytes;
  scrape.idle_timeout_s = limits.idle_timeout_s;
  scrape.header_timeout_s = limits.header_timeout_s;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> metrics_http =
      MetricsHttpServer::Create(scrape, metrics_.get());
  if (!metrics_http.ok()) return metrics_http.status();
  metrics_http_ = *std::move(metrics_http);
  return absl::OkStatus();
}

absl::Status Server::StartLocal() {
  if (config_.local.socket_path.empty()) return absl::OkStatus();
  LocalOptions options = config_.local;
  options.auth = auth_.get();
  LocalServices services;
  services.runtime = runtime_.get();
  services.sequences = sequences_.get();
  services.heap_retention = heap_retention_.get();
  options.spin_us = options.SpinUsFor(std::thread::hardware_concurrency());
  services.spin = absl::Microseconds(options.spin_us);
  absl::StatusOr<std::unique_ptr<LocalListener>> local = LocalListener::Start(options, services);
  if (!local.ok()) {
    // A path that is taken or refused is the operator's to fix, like a bad flag (exit 2).
    const absl::StatusCode code = local.status().code();
    if (code == absl::StatusCode::kFailedPrecondition || code == absl::StatusCode::kInvalidArgument) {
      return absl::InvalidArgumentError(local.status().message());
    }
    return local.status();
  }
  local_ = *std::move(local);
  return absl::OkStatus();
}

void Server::LogServing() const {
  const BackendCapabilities& caps = backend_.backend->capabilities();
  std::vector<std::string> devices;
  for (const DeviceDescription& d : caps.devices) {
    devices.push_back(absl::StrCat(d.index, ":", d.name, " (sm_", d.cc_major, d.cc_minor, ")"));
  }
  const std::string& host = config_.network.host;
  spdlog::info(
      "flashserve {} serving: backend={} ({}) devices=[{}] grpc={}:{} http={}:{} metrics={}:{} "
      "queue={} tls={} auth={}",
      kVersion, caps.name, backend_.reason, absl::StrJoin(devices, ", "), host, grpc_edge_->port(),
      host, http_edge_->port(), host, metrics_http_->port(), config_.scheduler.queue_capacity,
      config_.network.tls_cert_file.empty() ? "off" : "on", auth_ ? "bearer" : "off");
}

StopEvent Server::WaitForStop() {
  const StopEvent stop = flashserve::WaitForStop([this] { return runtime_->live(); });
  if (stop.reason == StopReason::kBackendUnhealthy) {
    grpc_edge_->SetServing(false);
    spdlog::error(
        "{}: gRPC health NOT_SERVING, HTTP ready and live 503; exiting with code {} after the "
        "grace period ({} s) so that the process is restarted",
        ProcessBroken() ? ProcessBrokenReason() : "backend unhealthy", ExitCodeFor(stop.reason),
        config_.shutdown.grace_seconds);
  }
  return stop;
}

bool Server::Drain(const StopEvent& stop) {
  const absl::Time deadline = absl::Now() + absl::Seconds(config_.shutdown.grace_seconds);
  grpc_edge_->SetServing(false);
  if (stop.reason == StopReason::kSignal) {
    spdlog::info("{} received: draining (grace {}s; a second signal stops at once)",
                 SignalName(stop.signal_number), config_.shutdown.grace_seconds);
    runtime_->StopAccepting();  // new requests: UNAVAILABLE
    if (local_ != nullptr) local_->StopAccepting();  // no new connections; the socket file goes
  }
  // Native Attention calls are admitted when they start (edge/grpc/attention_call.h), so WaitIdle
  // also waits for requests still uploading; gRPC's Shutdown would cancel those. Then the answers
  // handed to gRPC -- native, KServe and striped downloads alike -- must still be written: a large
  // one to a slow reader can take seconds, and Shutdown's deadline would cut it off. A (second)
  // shutdown signal meanwhile ends the wait at once, as the end of the grace period does.
  int stop_now = 0;
  const auto wait = [&](const std::function<bool(absl::Time)>& idle) {
    return stop_now == 0 && WaitUnlessSignalled(idle, deadline, &stop_now);
  };
  const bool drained =
      wait([this](absl::Time until) { return runtime_->WaitIdle(until); }) &&
      wait([this](absl::Time until) { return grpc_edge_->WaitForDataCalls(until); }) &&
      (local_ == nullptr || wait([this](absl::Time until) { return local_->WaitIdle(until); }));
  if (stop.reason == StopReason::kBackendUnhealthy) {
    // Requests meanwhile get UNAVAILABLE from the backend, naming the fault.
    if (stop_now == 0) stop_now = WaitForSignalUntil(deadline);
    runtime_->StopAccepting();
  }
  if (stop_now != 0) {
    spdlog::warn(
        "{} received: stopping now (the shutdown may take {} s more; a further signal ends the "
        "process at once)",
        SignalName(stop_now), ShutdownOptions::kShutdownOverrunSeconds);
  }
  // gRPC's Shutdown and the teardown wait for every launch the device accepted; a hung one would
  // hold them for the rest of the watchdog's limit (main.cc), grace period included, with nobody
  // taking signals. From here the watchdog takes them: "stop now" bounds what is left by
  // kShutdownOverrunSeconds, and a signal after it exits at once.
  WatchShutdownSignals(stop_now != 0);
  if (!drained) {
    spdlog::warn(stop_now != 0 ? "cancelling the requests still running"
                               : "grace period over with requests still running; cancelling them");
    runtime_->CancelRunning();  // running CPU work stops; gRPC's Shutdown below ends the calls
  }
  grpc_edge_->Shutdown(drained ? absl::Now() + absl::Seconds(1) : absl::Now());
  spdlog::debug("shutdown: gRPC stopped");
  if (local_ != nullptr) local_->Stop(drained);
  // Past the grace period nothing more is waited for, as for gRPC above.
  http_edge_->Stop(drained ? absl::Seconds(10) : absl::ZeroDuration());
  spdlog::debug("shutdown: HTTP stopped");
  metrics_http_->Stop();  // before the scheduler its queue-depth callback reads goes away
  spdlog::info("stopped");
  return drained;
}

}  // namespace flashserve
