#include "common/work_queue.h"

#include <algorithm>
#include <utility>

namespace flashserve {

WorkQueue::WorkQueue(int threads, int capacity) : capacity_(size_t(std::max(capacity, 1))) {
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool WorkQueue::TrySubmit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || tasks_.size() >= capacity_) return false;
    tasks_.push_back(std::move(task));
  }
  ready_.notify_one();
  return true;
}

void WorkQueue::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, and nothing is left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace flashserve
