// The jobs that still use an object (queued on the scheduler, or awaiting the backend's
// completion), so that its destructor can wait for the last one.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "spdlog/spdlog.h"

namespace flashserve {

/// Thread-safe.
class JobCount {
 public:
  /// Counts one job while it lives. Destroy it after the job's last use of the owner.
  class Ticket {
   public:
    explicit Ticket(JobCount* count) : count_(count) {
      std::lock_guard<std::mutex> lock(count_->mu_);
      ++count_->jobs_;
    }
    ~Ticket() {
      // Notify under the lock: once jobs_ reaches 0 WaitForNone may return and the owner (and
      // this count with it) be freed.
      std::lock_guard<std::mutex> lock(count_->mu_);
      if (--count_->jobs_ == 0) count_->none_.notify_all();
    }
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    JobCount* const count_;
  };

  /// Waits, without a bound, until no Ticket lives; logs every 10 s what still waits (`owner`).
  /// A device that never completes a launch holds this for good: the process's shutdown bound
  /// ends that (ExitIfShutdownOutlasts, config/serve_loop.h).
  void WaitForNone(const char* owner) {
    std::unique_lock<std::mutex> lock(mu_);
    while (!none_.wait_for(lock, std::chrono::seconds(10), [this] { return jobs_ == 0; }))
      spdlog::warn("{} teardown: still waiting for {} jobs", owner, jobs_);
  }

 private:
  std::mutex mu_;
  std::condition_variable none_;  // jobs_ reached 0
  int64_t jobs_ = 0;              // guarded by mu_
};

}  // namespace flashserve
