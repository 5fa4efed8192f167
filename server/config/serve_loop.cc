#include "config/serve_loop.h"

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "absl/time/clock.h"
#include "config/server_config.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// SIGHUP (a terminal's hang-up) drains rather than kills -- unless the process was started with
// it ignored (nohup): a blocked signal is never discarded, so taking it would stop a server its
// operator meant to outlive the session. Read once, in BlockShutdownSignals (first thing in main).
sigset_t ShutdownSignals() {
  static const sigset_t signals = [] {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    struct sigaction hangup {};
    if (sigaction(SIGHUP, nullptr, &hangup) == 0 && hangup.sa_handler != SIG_IGN) {
      sigaddset(&set, SIGHUP);
    }
    return set;
  }();
  return signals;
}

// A shutdown signal if one arrives within `wait` (then its number), else 0.
int TakeSignal(absl::Duration wait) {
  const sigset_t signals = ShutdownSignals();
  const timespec timeout = absl::ToTimespec(std::max(wait, absl::ZeroDuration()));
  const int taken = sigtimedwait(&signals, nullptr, &timeout);
  return taken > 0 ? taken : 0;
}

}  // namespace

void BlockShutdownSignals() {
  const sigset_t signals = ShutdownSignals();
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
}

StopEvent WaitForStop(const std::function<bool()>& live, absl::Duration tick) {
  StopEvent event;
  for (;;) {
    if (int taken = TakeSignal(tick); taken != 0) {
      event.signal_number = taken;
      return event;
    }
    if (!live()) {
      event.reason = StopReason::kBackendUnhealthy;
      return event;
    }
  }
}

bool ShutdownSignalPending() { return TakeSignal(absl::ZeroDuration()) != 0; }

int WaitForSignalUntil(absl::Time deadline) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return 0;
    if (int taken = TakeSignal(std::min(left, absl::Seconds(1))); taken != 0) return taken;
  }
}

bool WaitUnlessSignalled(const std::function<bool(absl::Time)>& wait, absl::Time deadline,
                         int* signal_number) {
  for (;;) {
    if (wait(std::min(deadline, absl::Now() + absl::Milliseconds(100)))) return true;
    if (int taken = TakeSignal(absl::ZeroDuration()); taken != 0) {
      *signal_number = taken;
      return false;
    }
    if (absl::Now() >= deadline) return false;
  }
}

const char* SignalName(int signal_number) {
  switch (signal_number) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return strsignal(signal_number);
  }
}

int ExitCodeFor(StopReason reason) {
  return reason == StopReason::kBackendUnhealthy ? ShutdownOptions::kExitBackendUnhealthy
                                                 : ShutdownOptions::kExitOk;
}

void ExitIfShutdownOutlasts(absl::Duration limit, int exit_code) {
  std::thread([limit, exit_code] {
    absl::SleepFor(limit);
    spdlog::error(
        "shutdown still running after {} s (a device launch that never completes?); "
        "exiting now with code {}",
        absl::ToInt64Seconds(limit), exit_code);
    spdlog::default_logger()->flush();
    std::_Exit(exit_code);
  }).detach();
}

}  // namespace flashserve
