// Tunes unseen problem classes off the request path, one at a time, and remembers the winners.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"

namespace flashserve {

/// Thread-safe. Lookup never waits for tuning: a miss returns nullopt (the caller uses the
/// heuristic default) and queues the class; a worker thread tunes queued classes one by one,
/// stores each winner in the cache and saves the cache file.
class BackgroundTuner {
 public:
  /// Times the candidates of one class and returns the winner (runs on the tuner's thread).
  using TuneFn = std::function<absl::StatusOr<TuneRecord>(const ProblemClass&)>;
  /// Tunes one class of another kind (e.g. a DecodeClass); runs on the tuner's thread.
  using JobFn = std::function<absl::StatusOr<TuneRecord>()>;
  /// Called with "hit", "miss", "tuned" or "failed" (for metrics); may be empty.
  using EventFn = std::function<void(const char* event)>;

  struct Options {
    std::string cache_path;  // "" keeps results in memory only
    int max_pending = 256;   // classes waiting; further misses are not queued (served by default)
  };

  BackgroundTuner(TuneCache* cache, TuneFn tune, Options options, EventFn on_event = {});
  ~BackgroundTuner();  // finishes the class being tuned, drops the rest

  /// The tuned config name for `c`, or nullopt (then `c` is queued for tuning once).
  std::optional<std::string> Lookup(const ProblemClass& c);
  /// Queues `c` unless it is cached, queued or being tuned.
  void Enqueue(const ProblemClass& c);
  /// The same for a class of another kind, named by its cache key (which must not collide with
  /// ProblemClass keys, e.g. "decode|..."); `job` tunes it when queued.
  std::optional<std::string> Lookup(const std::string& key, JobFn job);
  void Enqueue(const std::string& key, JobFn job);
  /// Waits until nothing is queued or being tuned; false on timeout.
  bool WaitIdle(absl::Duration timeout);

 private:
  struct Job {
    std::string key;
    JobFn run;
  };
  void Loop();
  void Event(const char* event) {
    if (on_event_) on_event_(event);
  }

  TuneCache* const cache_;
  const TuneFn tune_;
  const Options options_;
  const EventFn on_event_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> known_ ABSL_GUARDED_BY(mu_);  // queued, running or finished (incl. failed)
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace flashserve
