// Tunes unseen problem classes off the request path, one at a time, and remembers the winners.
#pragma once

#include <deque>
#include <functional>
#include <map>
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
  /// Called with "hit", "miss", "tuned", "failed" or "skipped" (a miss not queued: the tuner
  /// holds max_classes) for metrics; may be empty.
  using EventFn = std::function<void(const char* event)>;

  struct Options {
    std::string cache_path;  // "" keeps results in memory only
    int max_pending = 256;   // classes waiting; further misses are not queued (served by default)
    // Classes cached, queued or failed: past it misses are not queued. Decode classes are keyed
    // by a client's head counts and shapes, so without a bound clients grow the cache (and its
    // file, unreadable past TuneCache::kMaxFileBytes) and keep the GPU tuning.
    int max_classes = 4096;
    // A failed class (e.g. no device memory for its timing while requests held it) is queued
    // again by a miss this long after, at most max_failures times in all.
    absl::Duration retry_failed_after = absl::Minutes(10);
    int max_failures = 3;
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
  void RunJob(Job& job);
  /// Whether `key` may be queued now (not queued, running, given up on or past the bounds).
  bool MayQueueLocked(const std::string& key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ClassesHeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Event(const char* event) {
    if (on_event_) on_event_(event);
  }

  TuneCache* const cache_;
  const TuneFn tune_;
  const Options options_;
  const EventFn on_event_;
  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  struct Failures {
    int count = 0;
    absl::Time retry_at;
  };
  std::set<std::string> known_ ABSL_GUARDED_BY(mu_);  // queued or running
  std::map<std::string, Failures> failed_ ABSL_GUARDED_BY(mu_);
  bool warned_full_ ABSL_GUARDED_BY(mu_) = false;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace flashserve
