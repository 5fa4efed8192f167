// flashserve: exact attention as a service. Reads the flags into a ServerConfig
// (config/flags.cc), starts the server (config/server.cc), waits for a shutdown signal or an
// unhealthy backend and drains.
//
// Exit codes (README "Server flags", ShutdownOptions): 0 after a drain on SIGINT/SIGTERM/SIGHUP (a
// second signal during it cancels what is left at once, as the grace period's end does); 1 when
// the server cannot start (a port in use, no usable backend); 2 for a refused flag or file, or a
// value the server cannot use (a KV pool it cannot map, a --host it cannot listen on); 3 when
// the backend turned unhealthy (a sticky CUDA fault): the process drains for
// --shutdown_grace_seconds and exits so that its supervisor restarts it with a fresh GPU context;
// 3 also when the shutdown outlasts the grace period by over 20 s (a device launch that never
// completes), or 20 s after a second signal (kShutdownOverrunSeconds), and at once at a signal
// after that second one (a forced stop: WatchShutdownSignals). A shutdown signal during startup
// exits 0 too, within kStartupStopGrace and without a drain (StartupSignalWatch): nothing was
// served yet.
#include <csignal>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "config/flags.h"
#include "config/serve_loop.h"
#include "config/server.h"
#include "config/server_config.h"
#include "spdlog/spdlog.h"

int main(int argc, char** argv) {
  using flashserve::ShutdownOptions;
  // A log pipe whose reader went away (a log shipper that crashed, `| head`) must cost the log
  // line, not the process: SIGPIPE killed it at the next line a gRPC thread or the drain wrote.
  std::signal(SIGPIPE, SIG_IGN);
  // Flags first, with the signals still at their default (parsing starts no thread): a flag file
  // that took long to read could be stopped. Then, before any thread starts, the mask, so that
  // every thread inherits it and only the waits of config/serve_loop.h take them: during the
  // start the watch's (a start held by a DNS lookup or a GPU still stops within a second), then
  // the main thread's.
  if (std::optional<int> exit_code = flashserve::ParseServerFlags(argc, argv)) return *exit_code;
  flashserve::BlockShutdownSignals();
  flashserve::StartupSignalWatch startup_watch;

  absl::StatusOr<flashserve::ServerConfig> config = flashserve::ServerConfigFromFlags();
  if (!config.ok()) {
    flashserve::ReportConfigError(config.status());
    return ShutdownOptions::kExitBadConfig;
  }
  absl::StatusOr<std::unique_ptr<flashserve::Server>> server = flashserve::Server::Start(*config);
  if (!server.ok() && server.status().code() == absl::StatusCode::kCancelled) {
    spdlog::info("stopped before serving: {}", std::string(server.status().message()));
    return ShutdownOptions::kExitOk;  // a shutdown signal during startup (tuning): what was asked
  }
  if (!server.ok()) {
    spdlog::error("{}", std::string(server.status().message()));
    // A file a flag names that is missing or unreadable (--tls_cert, ...) is a refused flag too.
    const absl::StatusCode code = server.status().code();
    return code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kNotFound ||
                   code == absl::StatusCode::kPermissionDenied
               ? ShutdownOptions::kExitBadConfig
               : ShutdownOptions::kExitStartFailed;
  }
  startup_watch.End();  // a signal it took goes to the wait below: the drain as for any other
  const flashserve::StopEvent stop = (*server)->WaitForStop();
  flashserve::ExitIfShutdownOutlasts(
      absl::Seconds(config->shutdown.grace_seconds + ShutdownOptions::kShutdownOverrunSeconds),
      ShutdownOptions::kExitBackendUnhealthy);
  (*server)->Drain(stop);
  // A signal that came with (or just before) a device fault still ends in a restart.
  const int exit_code = flashserve::ExitCodeFor(
      (*server)->live() ? stop.reason : flashserve::StopReason::kBackendUnhealthy);
  server->reset();  // the destructors, bounded by the limit above
  return exit_code;
}
