#include "config/serve_loop.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
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

namespace {

// The shutdown's watchdog (ExitIfShutdownOutlasts, WatchShutdownSignals). Never destroyed: its
// thread may still run while the process exits.
struct Watchdog {
  std::mutex mu;
  std::condition_variable changed;  // takes_signals set
  bool armed = false;
  absl::Time started;  // when the shutdown began
  absl::Time deadline = absl::InfiniteFuture();
  int exit_code = ShutdownOptions::kExitBackendUnhealthy;
  bool takes_signals = false;  // the main thread has handed the shutdown signals over
  bool stopping_now = false;   // a signal cut the drain short
};

Watchdog& TheWatchdog() {
  static Watchdog* const watchdog = new Watchdog();
  return *watchdog;
}

[[noreturn]] void ExitNow(int exit_code) {
  spdlog::default_logger()->flush();
  std::_Exit(exit_code);  // no destructors: the one stuck would never return
}

// "Stop now" (a second signal): the shutdown may take kShutdownOverrunSeconds more, as after the
// end of the grace period. Under w.mu.
void StopNowLocked(Watchdog& w) {
  w.stopping_now = true;
  w.deadline =
      std::min(w.deadline, absl::Now() + absl::Seconds(ShutdownOptions::kShutdownOverrunSeconds));
}

void RunWatchdog(Watchdog& w) {
  std::unique_lock<std::mutex> lock(w.mu);
  for (;;) {
    const absl::Time now = absl::Now();
    if (now >= w.deadline) {
      spdlog::error(
          "shutdown still running after {} s (a device launch that never completes?); "
          "exiting now with code {}",
          absl::ToInt64Seconds(now - w.started), w.exit_code);
      ExitNow(w.exit_code);
    }
    if (!w.takes_signals) {
      w.changed.wait_until(lock, absl::ToChronoTime(std::min(w.deadline, now + absl::Hours(1))));
      continue;
    }
    // Only this thread changes the deadline from here on.
    const absl::Duration left = w.deadline - now;
    lock.unlock();
    const int taken = TakeSignal(std::min(left, absl::Seconds(1)));
    lock.lock();
    if (taken == 0) continue;
    if (w.stopping_now) {
      spdlog::error("{} received again: exiting now with code {}, the shutdown unfinished",
                    SignalName(taken), w.exit_code);
      ExitNow(w.exit_code);
    }
    StopNowLocked(w);
    spdlog::warn(
        "{} received: stopping now (exit {} if the shutdown still runs in {} s; another signal "
        "exits at once)",
        SignalName(taken), w.exit_code, ShutdownOptions::kShutdownOverrunSeconds);
  }
}

}  // namespace

void ExitIfShutdownOutlasts(absl::Duration limit, int exit_code) {
  Watchdog& w = TheWatchdog();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.armed) return;
    w.armed = true;
    w.started = absl::Now();
    w.deadline = w.started + limit;
    w.exit_code = exit_code;
  }
  std::thread([watchdog = &w] { RunWatchdog(*watchdog); }).detach();
}

void WatchShutdownSignals(bool stopping_now) {
  Watchdog& w = TheWatchdog();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    if (!w.armed || w.takes_signals) return;
    if (stopping_now) StopNowLocked(w);
    w.takes_signals = true;
  }
  w.changed.notify_all();
}

}  // namespace flashserve
