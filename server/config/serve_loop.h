// How the serving process waits for its end and what it exits with: a shutdown signal (SIGINT,
// SIGTERM or SIGHUP: drain, exit 0; a second one during the drain stops it at once, exit 0, and a
// third, while the teardown still waits for a launch, exits 3 at once) or a
// backend that turned unhealthy (a sticky device fault: drain, exit 3, so that the supervisor --
// Kubernetes, systemd, docker --restart -- starts a fresh process with a working GPU context
// instead of keeping a zombie that holds the GPU and answers nothing).
#pragma once

#include <functional>
#include <thread>

#include "absl/time/time.h"

namespace flashserve {

enum class StopReason {
  kSignal,            // SIGINT, SIGTERM or SIGHUP
  kBackendUnhealthy,  // live() turned false
};

struct StopEvent {
  StopReason reason = StopReason::kSignal;
  int signal_number = 0;  // with kSignal
};

/// Blocks the shutdown signals (SIGINT, SIGTERM, SIGHUP) in the calling thread, and so in every
/// thread it starts later: only the waits below take them. Call first thing in main.
void BlockShutdownSignals();

/// How long startup work that polls StartupStopRequested() (startup tuning) has to unwind after a
/// shutdown signal before StartupSignalWatch ends the process itself.
inline constexpr absl::Duration kStartupStopGrace = absl::Milliseconds(500);

/// Takes the shutdown signals while the server starts. Without it they waited, blocked, for the
/// serve loop's first wait: a start held by a DNS lookup for --host, a GPU's initialisation or a
/// listener's bind ignored the SIGTERM of `docker stop` / Kubernetes until their SIGKILL.
/// At a signal it logs "<SIGNAL> received during startup" and StartupStopRequested() turns
/// true; if the startup has not ended kStartupStopGrace later, the process exits kExitOk at
/// once, running no destructors (what holds the start may never return, and its threads are
/// running). Start it right after BlockShutdownSignals; one at a time; main thread only.
class StartupSignalWatch {
 public:
  StartupSignalWatch();
  ~StartupSignalWatch() { End(); }
  StartupSignalWatch(const StartupSignalWatch&) = delete;
  StartupSignalWatch& operator=(const StartupSignalWatch&) = delete;

  /// The startup is over (served or failed): the serve loop's waits take the signals from here. A
  /// signal the watch took is raised again for them: a server that did start drains as usual.
  void End();

 private:
  int signal_fd_ = -1;  // reads the pending shutdown signals
  int wake_fd_ = -1;    // End() wakes the watch through it
  std::thread watch_;
};

/// Whether a shutdown signal asked the startup to stop: taken by the StartupSignalWatch, or
/// without one running, pending (taken then: it counts once).
bool StartupStopRequested();

/// Waits for a shutdown signal or for `live` to return false, asking it every `tick`.
StopEvent WaitForStop(const std::function<bool()>& live, absl::Duration tick = absl::Seconds(1));

/// Whether a shutdown signal came (taken: it counts once), without waiting.
bool ShutdownSignalPending();

/// Waits until `deadline` or a shutdown signal, whichever comes first: the signal's number, else 0.
int WaitForSignalUntil(absl::Time deadline);

/// Calls `wait(until)` -- which waits for something until `until` and says whether it came -- in
/// slices of 100 ms up to `deadline`, taking a shutdown signal between them: true once it came;
/// false at the deadline or at a signal (its number then in *signal_number). A second signal
/// during a drain cuts it short this way.
bool WaitUnlessSignalled(const std::function<bool(absl::Time)>& wait, absl::Time deadline,
                         int* signal_number);

/// "SIGTERM", "SIGINT", "SIGHUP", else strsignal's description.
const char* SignalName(int signal_number);

/// The process's exit code for how it stopped (ShutdownOptions::kExit*).
int ExitCodeFor(StopReason reason);

/// Bounds the shutdown: if the process is still running `limit` from now, logs and ends it at
/// once with `exit_code`, running no destructors. The end of a drain (gRPC's Shutdown waits for
/// every call's answer) and the teardown after it (AttentionRuntime, the backend's completion
/// threads) wait for every launch the device accepted, and a hung device never completes one;
/// the supervisor should restart the process, not find it stuck with its signals blocked.
/// Starts a detached thread (the watchdog); call once, when the shutdown begins.
void ExitIfShutdownOutlasts(absl::Duration limit, int exit_code);

/// Call once the drain's waits are over, before the teardown that may hang: from here on the
/// main thread takes no shutdown signal, the watchdog of ExitIfShutdownOutlasts does. "Stop
/// now" -- `stopping_now` (a signal cut the drain short), else the first signal the watchdog
/// takes -- brings its limit forward to ShutdownOptions::kShutdownOverrunSeconds from then, as
/// the end of the grace period does: a launch that never completes no longer holds the process
/// up to the grace period's end. A signal after "stop now" ends the process at once with the
/// watchdog's exit code (a forced stop: no destructors). Does nothing without the watchdog.
void WatchShutdownSignals(bool stopping_now);

}  // namespace flashserve
