// Copies of large requests spread over a few threads. One thread copies ~6 GB/s into pinned memory
// on the GPU hosts (bench/results/service-*), so a 400 MB request spent ~70 ms in its one host copy;
// memory bandwidth allows several times that with a few threads.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace flashserve {

struct CopyPiece {
  char* dest;
  const char* src;
  size_t bytes;
};

/// Thread-safe. The calling thread always takes part, so a copy progresses even when every helper is
/// busy with other callers' copies.
class ParallelCopier {
 public:
  /// `helpers` extra threads (0: every copy runs on its caller); copies smaller than
  /// `min_parallel_bytes` run on the caller alone.
  explicit ParallelCopier(int helpers, size_t min_parallel_bytes = size_t{4} << 20);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  /// Copies every piece; returns when all are done.
  void Copy(const std::vector<CopyPiece>& pieces);

  int helpers() const { return int(threads_.size()); }

 private:
  struct Job;
  void HelperLoop();
  static void Work(Job* job);

  const size_t min_parallel_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;  // jobs helpers may join
  bool exiting_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace flashserve
