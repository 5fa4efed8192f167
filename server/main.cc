// flashserve: exact attention as a service. Parses flags into options structs, wires the
// backend, scheduler and edges together, and handles SIGINT/SIGTERM with a graceful drain.
#include <csignal>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/version.h"
#include "edge/grpc_edge.h"
#include "edge/http_edge.h"
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
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: auto (CUDA when a usable GPU exists, else CPU), cuda or cpu");
ABSL_FLAG(std::string, devices, "", "CUDA devices to use, e.g. \"0,1\"; empty: all visible");
ABSL_FLAG(int64_t, max_request_bytes, int64_t{1} << 30,
          "Largest serialized request accepted (bytes, at most 2147483647); larger ones get "
          "RESOURCE_EXHAUSTED before they are read");
ABSL_FLAG(int64_t, max_tensor_elements, int64_t{1} << 28,
          "Largest element count of one tensor (Q, K or V); larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(
    int, queue_capacity, 64,
    "Requests that may wait for a worker; when full, new ones get RESOURCE_EXHAUSTED at once");
ABSL_FLAG(int, worker_threads, 0, "CPU backend compute threads; 0 uses every core");
ABSL_FLAG(
    int, shutdown_grace_seconds, 10,
    "On SIGINT/SIGTERM: how long in-flight requests may take to finish before they are cancelled");
ABSL_FLAG(std::string, log_level, "info",
          "Log level: trace, debug, info, warn, error, critical, off (debug: one line per request)");
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
                            std::pair{"http_port", absl::GetFlag(FLAGS_http_port)}}) {
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
  absl::StatusOr<std::vector<int>> devices = ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) {
    spdlog::error("{}", std::string(devices.status().message()));
    return 2;
  }

  BackendOptions backend_options;
  backend_options.kind = absl::GetFlag(FLAGS_backend);
  backend_options.cpu_threads = absl::GetFlag(FLAGS_worker_threads);
  backend_options.devices = *devices;
  absl::StatusOr<CreatedBackend> created = CreateBackend(backend_options);
  if (!created.ok()) {
    spdlog::error("backend: {}", std::string(created.status().message()));
    return 1;
  }
  Backend& backend = *created->backend;

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
  AttentionRuntime runtime(&backend, scheduler->get(), limits);

  ServerIdentity identity;
  identity.version = kVersion;
  identity.build = kBuildSummary;
  identity.worker_threads = absl::GetFlag(FLAGS_worker_threads) > 0
                                ? absl::GetFlag(FLAGS_worker_threads)
                                : int(std::thread::hardware_concurrency());
  identity.queue_capacity = scheduler_options.queue_capacity;
  identity.max_request_bytes = absl::GetFlag(FLAGS_max_request_bytes);

  GrpcOptions grpc_options;
  grpc_options.host = absl::GetFlag(FLAGS_host);
  grpc_options.port = absl::GetFlag(FLAGS_grpc_port);
  grpc_options.max_request_bytes = identity.max_request_bytes;
  absl::StatusOr<std::unique_ptr<GrpcEdge>> grpc_edge =
      GrpcEdge::Create(grpc_options, &runtime, identity);
  if (!grpc_edge.ok()) {
    spdlog::error("{}", std::string(grpc_edge.status().message()));
    return 1;
  }
  HttpOptions http_options;
  http_options.host = grpc_options.host;
  http_options.port = absl::GetFlag(FLAGS_http_port);
  absl::StatusOr<std::unique_ptr<HttpEdge>> http_edge = HttpEdge::Create(http_options, &runtime);
  if (!http_edge.ok()) {
    spdlog::error("{}", std::string(http_edge.status().message()));
    return 1;
  }

  std::vector<std::string> device_names;
  for (const DeviceDescription& d : caps.devices) {
    device_names.push_back(
        absl::StrCat(d.index, ":", d.name, " (sm_", d.cc_major, d.cc_minor, ")"));
  }
  spdlog::info("flashserve {} serving: backend={} ({}) devices=[{}] grpc={}:{} http={}:{} queue={}",
               kVersion, caps.name, created->reason, absl::StrJoin(device_names, ", "),
               grpc_options.host, (*grpc_edge)->port(), http_options.host, (*http_edge)->port(),
               scheduler_options.queue_capacity);

  // Wait for SIGINT/SIGTERM (blocked in every thread; taken here synchronously).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int signal_number = 0;
  sigwait(&signals, &signal_number);

  const absl::Duration grace = absl::Seconds(absl::GetFlag(FLAGS_shutdown_grace_seconds));
  const absl::Time deadline = absl::Now() + grace;
  spdlog::info("{} received: draining (grace {}s)", strsignal(signal_number),
               absl::GetFlag(FLAGS_shutdown_grace_seconds));
  (*grpc_edge)->SetServing(false);
  runtime.StopAccepting();  // new requests: UNAVAILABLE
  const bool drained = (*scheduler)->WaitIdle(deadline);
  if (!drained) spdlog::warn("grace period over with requests still running; cancelling them");
  (*grpc_edge)->Shutdown(drained ? absl::Now() + absl::Seconds(1) : absl::Now());
  (*http_edge)->Stop();
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
  absl::ParseCommandLine(argc, argv);
  return flashserve::Serve();
}
