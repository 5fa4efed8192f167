#include "autotune/background_tuner.h"

#include "spdlog/spdlog.h"

namespace flashserve {

BackgroundTuner::BackgroundTuner(TuneCache* cache, TuneFn tune, Options options, EventFn on_event)
    : cache_(cache),
      tune_(std::move(tune)),
      options_(std::move(options)),
      on_event_(std::move(on_event)),
      thread_([this] { Loop(); }) {}

BackgroundTuner::~BackgroundTuner() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

std::optional<std::string> BackgroundTuner::Lookup(const ProblemClass& c) {
  const std::string key = c.key();
  if (std::optional<TuneRecord> record = cache_->Find(key)) {  // no job built on a hit
    Event("hit");
    return record->config;
  }
  Event("miss");
  Enqueue(key, [this, c] { return tune_(c); });
  return std::nullopt;
}

void BackgroundTuner::Enqueue(const ProblemClass& c) {
  Enqueue(c.key(), [this, c] { return tune_(c); });
}

std::optional<std::string> BackgroundTuner::Lookup(const std::string& key, JobFn job) {
  if (std::optional<TuneRecord> record = cache_->Find(key)) {
    Event("hit");
    return record->config;
  }
  Event("miss");
  Enqueue(key, std::move(job));
  return std::nullopt;
}

void BackgroundTuner::Enqueue(const std::string& key, JobFn job) {
  if (cache_->Find(key)) return;
  absl::MutexLock lock(&mu_);
  if (!MayQueueLocked(key)) return;
  known_.insert(key);
  queue_.push_back(Job{key, std::move(job)});
}

bool BackgroundTuner::MayQueueLocked(const std::string& key) {
  if (known_.count(key) || int(queue_.size()) >= options_.max_pending) return false;
  auto failed = failed_.find(key);
  if (failed != failed_.end()) {
    return failed->second.count < options_.max_failures && absl::Now() >= failed->second.retry_at;
  }
  if (ClassesHeldLocked() < size_t(options_.max_classes)) return true;
  Event("skipped");
  if (!warned_full_) {
    warned_full_ = true;
    spdlog::warn(
        "autotune: {} classes cached, queued or failed reach --tune_max_classes; further "
        "classes keep the heuristic default",
        options_.max_classes);
  }
  return false;
}

// Cached, queued or failed, each class once: a failed class queued again is in known_ and
// failed_ (counted twice, it made the cap refuse a class early).
size_t BackgroundTuner::ClassesHeldLocked() const {
  size_t held = cache_->size() + known_.size() + failed_.size();
  for (const std::string& key : known_) held -= failed_.count(key);
  return held;
}

bool BackgroundTuner::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void BackgroundTuner::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    RunJob(job);
    absl::MutexLock lock(&mu_);
    known_.erase(job.key);  // tuned: in the cache; failed: in failed_
    busy_ = false;
  }
}

void BackgroundTuner::RunJob(Job& job) {
  if (cache_->Find(job.key)) return;  // queued again between its Put and leaving known_
  const absl::Time start = absl::Now();
  absl::StatusOr<TuneRecord> record = job.run();
  if (!record.ok()) {
    Event("failed");
    absl::MutexLock lock(&mu_);
    Failures& f = failed_[job.key];
    f.count++;
    f.retry_at = absl::Now() + options_.retry_failed_after;
    spdlog::warn("autotune {} failed ({} of {} tries): {}", job.key, f.count, options_.max_failures,
                 std::string(record.status().message()));
    return;
  }
  cache_->Put(job.key, *record);
  {
    absl::MutexLock lock(&mu_);
    failed_.erase(job.key);
  }
  Event("tuned");
  const double speedup = record->default_tflops > 0 ? record->tflops / record->default_tflops : 0;
  // Throughput unit: TFLOPS for attention classes, K/V TB/s for decode classes.
  spdlog::info("autotune {}: {} at {:.2f} ({:.2f}x the default {}) in {:.1f} s", job.key,
               record->config, record->tflops, speedup, record->default_config,
               absl::ToDoubleSeconds(absl::Now() - start));
  if (!options_.cache_path.empty()) {
    if (absl::Status s = cache_->Save(options_.cache_path); !s.ok()) {
      spdlog::warn("autotune: cannot save the cache: {}", std::string(s.message()));
    }
  }
}

}  // namespace flashserve
