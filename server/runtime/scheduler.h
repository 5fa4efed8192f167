// Bounded FIFO of jobs in front of the backend, drained by a fixed set of worker threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace flashserve {

struct SchedulerOptions {
  int queue_capacity = 64;  // jobs waiting (not counting running ones); full -> RESOURCE_EXHAUSTED
  int num_workers = 1;      // jobs running at once (the backend's choice, not a flag)

  /// INVALID_ARGUMENT naming --queue_capacity when it is < 1.
  absl::Status Check() const {
    return queue_capacity >= 1 ? absl::OkStatus()
                               : absl::InvalidArgumentError("--queue_capacity must be >= 1");
  }
};

/// Thread-safe. Every accepted job runs exactly once, on a worker thread; a job decides
/// itself (deadline, cancellation) whether to do its work when it starts.
class Scheduler {
 public:
  using Job = std::function<void()>;

  static absl::StatusOr<std::unique_ptr<Scheduler>> Create(const SchedulerOptions& options);
  ~Scheduler();  // stops accepting, runs what was accepted, joins the workers

  /// OK: the job will run. RESOURCE_EXHAUSTED: the queue is full. UNAVAILABLE: shutting down.
  absl::Status Submit(Job job);

  /// Like Submit, but runs the job on the calling thread, before returning, when a worker would be
  /// idle anyway (queue empty, fewer than num_workers jobs running): that skips the hand-off to a
  /// worker thread (a wake-up of tens of microseconds). Only for jobs that return quickly.
  absl::Status SubmitOrRunInline(Job job);

  /// New submissions get UNAVAILABLE from now on.
  void StopAccepting();
  /// Waits until no job is queued or running; false if `deadline` came first.
  bool WaitIdle(absl::Time deadline);

  int queue_depth() const;
  int running() const;
  int num_workers() const { return options_.num_workers; }

 private:
  explicit Scheduler(const SchedulerOptions& options);
  void WorkerLoop();

  const SchedulerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // a job was queued, or exiting_
  std::condition_variable idle_cv_;  // a job finished
  std::deque<Job> queue_;
  int running_ = 0;
  bool accepting_ = true;
  bool exiting_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace flashserve
