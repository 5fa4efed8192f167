// CPU attention: the embedded backend on machines without a GPU and the oracle for GPU tests.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "flashserve/kernels/attention_params.h"

namespace flashserve::kernels::cpu {

/// A fixed set of worker threads that runs index ranges in parallel.
/// Thread-safe: parallel_for may be called from several threads at once; calls share the workers.
class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);  // num_threads <= 0: hardware concurrency
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;
  /// Calls fn(i) for every i in [0, n) and returns when all calls have finished.
  /// The calling thread takes part in the work.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Largest head_dim the CPU backend accepts.
inline constexpr int kMaxHeadDim = 256;

/// Empty string when the CPU backend can run p, else a message naming the offending field.
std::string supported(const AttentionParams& p);

/// Exact attention by tiled online softmax with fp32 accumulation (fp16/bf16/fp32 inputs;
/// output in the input dtype). Writes p.o and, if non-null, p.lse.
/// Requires supported(p).empty(). pool == nullptr runs on the calling thread.
void attention_forward(const AttentionParams& p, ThreadPool* pool);

}  // namespace flashserve::kernels::cpu
