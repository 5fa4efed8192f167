#include "runtime/scheduler.h"

#include "absl/strings/str_cat.h"

namespace flashserve {

absl::StatusOr<std::unique_ptr<Scheduler>> Scheduler::Create(const SchedulerOptions& options) {
  if (options.queue_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_capacity must be >= 1, got ", options.queue_capacity));
  }
  if (options.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheduler workers must be >= 1, got ", options.num_workers));
  }
  return std::unique_ptr<Scheduler>(new Scheduler(options));
}

Scheduler::Scheduler(const SchedulerOptions& options) : options_(options) {
  workers_.reserve(options.num_workers);
  for (int i = 0; i < options.num_workers; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

Scheduler::~Scheduler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    accepting_ = false;
    exiting_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

absl::Status Scheduler::Submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return absl::UnavailableError("server is shutting down");
    if (int(queue_.size()) >= options_.queue_capacity) {
      return absl::ResourceExhaustedError(absl::StrCat("queue full (", options_.queue_capacity,
                                                       " requests waiting; --queue_capacity)"));
    }
    queue_.push_back(std::move(job));
  }
  work_cv_.notify_one();
  return absl::OkStatus();
}

absl::Status Scheduler::SubmitOrRunInline(Job job) {
  bool run_here = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (accepting_ && queue_.empty() && running_ < options_.num_workers) {
      ++running_;
      run_here = true;
    }
  }
  // Otherwise the ordinary path decides: queued, RESOURCE_EXHAUSTED or UNAVAILABLE.
  if (!run_here) return Submit(std::move(job));
  job();
  {
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
  }
  idle_cv_.notify_all();
  return absl::OkStatus();
}

void Scheduler::StopAccepting() {
  std::lock_guard<std::mutex> lock(mu_);
  accepting_ = false;
}

bool Scheduler::WaitIdle(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  while (!queue_.empty() || running_ > 0) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    idle_cv_.wait_for(lock, absl::ToChronoMicroseconds(left));
  }
  return true;
}

int Scheduler::queue_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return int(queue_.size());
}

int Scheduler::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

void Scheduler::WorkerLoop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return exiting_ || !queue_.empty(); });
      if (queue_.empty()) return;  // exiting_ and drained
      job = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mu_);
      --running_;
    }
    idle_cv_.notify_all();
  }
}

}  // namespace flashserve
