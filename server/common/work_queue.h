// A few threads of the server's own that run queued tasks in arrival order, for calls that may
// wait (for another call's copy, for a step's pin) and so must not wait on gRPC's callback
// threads: gRPC 1.51 has max(2, cores / 2) of those for every call of every service, and two
// waiting handlers stalled the whole gRPC server, health checks included.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace flashserve {

/// Thread-safe.
class WorkQueue {
 public:
  /// `threads` >= 1 run the tasks; at most `capacity` >= 1 wait to run.
  WorkQueue(int threads, int capacity);
  /// Runs every task still queued, then joins the threads.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  /// Queues `task`; false (nothing queued) when `capacity` tasks wait already.
  bool TrySubmit(std::function<void()> task);

 private:
  void Loop();

  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace flashserve
