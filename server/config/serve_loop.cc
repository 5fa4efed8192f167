#include "config/serve_loop.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <thread>
#include <utility>

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

// The startup's signal watch (StartupSignalWatch): StartupStopRequested reads it on any thread.
// Never destroyed, as the watchdog.
struct StartupWatchState {
  std::mutex mu;
  std::condition_variable ended_changed;
  bool running = false;  // from a watch's start to its End()
  bool ended = true;     // its End() has begun
  int taken = 0;         // the signal the watch took; 0 before
};

StartupWatchState& TheStartupWatch() {
  static StartupWatchState* const state = new StartupWatchState();
  return *state;
}

// A shutdown signal read from `signal_fd`, else 0 once `wake_fd` says the startup is over (a
// signal pending then stays pending, for the serve loop).
int ReadSignalUnlessWoken(int signal_fd, int wake_fd) {
  pollfd fds[] = {{wake_fd, POLLIN, 0}, {signal_fd, POLLIN, 0}};
  for (;;) {
    const int ready = poll(fds, 2, -1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      spdlog::warn("startup: waiting for shutdown signals failed: {}", std::strerror(errno));
      return 0;
    }
    if (fds[0].revents != 0) return 0;
    signalfd_siginfo info{};
    // Non-blocking: a signal another wait took in between (EAGAIN) means poll again.
    if (read(signal_fd, &info, sizeof(info)) == ssize_t(sizeof(info))) {
      return int(info.ssi_signo);
    }
  }
}

void WatchStartup(StartupWatchState& w, int signal_fd, int wake_fd) {
  const int taken = ReadSignalUnlessWoken(signal_fd, wake_fd);
  if (taken == 0) return;
  std::unique_lock<std::mutex> lock(w.mu);
  w.taken = taken;
  if (w.ended) return;  // started after all: End() hands the signal to the serve loop
  lock.unlock();        // a log line must not hold up End()
  spdlog::warn(
      "{} received during startup: stopping (exit {}; at once if the start still runs in {} ms)",
      SignalName(taken), ShutdownOptions::kExitOk, absl::ToInt64Milliseconds(kStartupStopGrace));
  lock.lock();
  if (w.ended_changed.wait_for(lock, absl::ToChronoNanoseconds(kStartupStopGrace),
                               [&w] { return w.ended; })) {
    return;
  }
  // Whatever holds the start (a lookup, a driver call) may never return, and destructors would
  // run beside the threads it started: end here, as the shutdown's watchdog does.
  spdlog::error("startup still running {} ms after {}: exiting now with code {}",
                absl::ToInt64Milliseconds(kStartupStopGrace), SignalName(taken),
                ShutdownOptions::kExitOk);
  ExitNow(ShutdownOptions::kExitOk);
}

}  // namespace

StartupSignalWatch::StartupSignalWatch() {
  const sigset_t signals = ShutdownSignals();
  signal_fd_ = signalfd(-1, &signals, SFD_NONBLOCK | SFD_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (signal_fd_ < 0 || wake_fd_ < 0) {
    spdlog::warn("startup: cannot watch for shutdown signals ({}); they wait until serving begins",
                 std::strerror(errno));
    if (signal_fd_ >= 0) close(signal_fd_);
    if (wake_fd_ >= 0) close(wake_fd_);
    return;
  }
  StartupWatchState& w = TheStartupWatch();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.running = true;
    w.ended = false;
    w.taken = 0;
  }
  watch_ = std::thread(
      [&w, signal_fd = signal_fd_, wake_fd = wake_fd_] { WatchStartup(w, signal_fd, wake_fd); });
}

void StartupSignalWatch::End() {
  if (!watch_.joinable()) return;
  StartupWatchState& w = TheStartupWatch();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.ended = true;
  }
  w.ended_changed.notify_all();
  const uint64_t wake = 1;
  if (write(wake_fd_, &wake, sizeof(wake)) < 0) {
    spdlog::warn("startup: cannot wake the signal watch: {}", std::strerror(errno));
  }
  watch_.join();
  close(signal_fd_);
  close(wake_fd_);
  int taken = 0;
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.running = false;
    std::swap(taken, w.taken);
  }
  // Blocked in every thread, it stays pending until the serve loop's wait takes it.
  if (taken != 0) kill(getpid(), taken);
}

bool StartupStopRequested() {
  {
    StartupWatchState& w = TheStartupWatch();
    std::lock_guard<std::mutex> lock(w.mu);
    if (w.running) return w.taken != 0;
  }
  return ShutdownSignalPending();
}

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
