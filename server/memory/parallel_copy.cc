#include "memory/parallel_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace flashserve {

// One Copy call: its pieces cut into blocks that the caller and the helpers claim one at a time.
struct ParallelCopier::Job {
  static constexpr size_t kBlock = size_t{1} << 20;
  std::vector<CopyPiece> blocks;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::mutex mu;
  std::condition_variable finished;
};

ParallelCopier::ParallelCopier(int helpers, size_t min_parallel_bytes)
    : min_parallel_bytes_(min_parallel_bytes) {
  for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { HelperLoop(); });
}

ParallelCopier::~ParallelCopier() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    exiting_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ParallelCopier::Work(Job* job) {
  for (size_t i = job->next.fetch_add(1); i < job->blocks.size(); i = job->next.fetch_add(1)) {
    const CopyPiece& b = job->blocks[i];
    std::memcpy(b.dest, b.src, b.bytes);
    if (job->done.fetch_add(1) + 1 == job->blocks.size()) {
      std::lock_guard<std::mutex> lock(job->mu);
      job->finished.notify_all();
    }
  }
}

void ParallelCopier::Copy(const std::vector<CopyPiece>& pieces) {
  size_t total = 0;
  for (const CopyPiece& p : pieces) total += p.bytes;
  if (threads_.empty() || total < min_parallel_bytes_) {
    for (const CopyPiece& p : pieces) std::memcpy(p.dest, p.src, p.bytes);
    return;
  }
  auto job = std::make_shared<Job>();
  for (const CopyPiece& p : pieces) {
    for (size_t off = 0; off < p.bytes; off += Job::kBlock) {
      job->blocks.push_back({p.dest + off, p.src + off, std::min(Job::kBlock, p.bytes - off)});
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(job);
  }
  cv_.notify_all();
  Work(job.get());
  {
    // Helpers may still be copying their last blocks.
    std::unique_lock<std::mutex> lock(job->mu);
    job->finished.wait(lock, [&] { return job->done.load() == job->blocks.size(); });
  }
  std::lock_guard<std::mutex> lock(mu_);
  jobs_.erase(std::remove(jobs_.begin(), jobs_.end(), job), jobs_.end());
}

void ParallelCopier::HelperLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        if (exiting_) return true;
        for (const auto& j : jobs_) {
          if (j->next.load() < j->blocks.size()) return true;
        }
        return false;
      });
      if (exiting_) return;
      for (const auto& j : jobs_) {
        if (j->next.load() < j->blocks.size()) {
          job = j;
          break;
        }
      }
    }
    if (job) Work(job.get());
  }
}

}  // namespace flashserve
