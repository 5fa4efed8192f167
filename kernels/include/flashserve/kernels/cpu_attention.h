// CPU attention: the embedded backend on machines without a GPU and the oracle for GPU tests.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "flashserve/kernels/attention_params.h"

namespace flashserve::kernels::cpu {

/// A fixed set of worker threads that runs index ranges in parallel.
/// Thread-safe: parallel_for may be called from several threads at once; calls share the workers.
class ThreadPool {
 public:
  // num_threads <= 0: hardware concurrency. Threads that cannot start are left out (a line on
  // stderr; num_threads() counts the ones running).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const;
  /// Calls fn(i) for every i in [0, n) and returns when all calls have finished.
  /// The calling thread takes part in the work.
  void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);
  /// Like parallel_for, but fn(i) returning false ends the job: indices not yet handed out are
  /// skipped, and the call returns once the calls already running have returned.
  void parallel_for_while(int64_t n, const std::function<bool(int64_t)>& fn);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Cooperative stop of a running attention_forward (a cancelled call, a passed deadline): the
/// kernel's threads look at it between key tiles (microseconds of work apart) and give up.
/// Thread-safe.
class StopSignal {
 public:
  /// `poll` (thread-safe, may be empty) is asked whether to stop at most once per
  /// `poll_every_ns` (rounded up to the coarse clock's 1-4 ms ticks), so it may read a clock or
  /// a gRPC context.
  explicit StopSignal(std::function<bool()> poll = {}, int64_t poll_every_ns = 1'000'000)
      : poll_(std::move(poll)), poll_every_ns_(poll_every_ns) {}
  /// Every kernel using this signal stops at its next check.
  void request() { stopped_.store(true, std::memory_order_relaxed); }
  /// The kernels' check: an atomic load, plus a coarse clock read (~4 ns) when there is a poll.
  bool stop_requested() { return stopped_.load(std::memory_order_relaxed) || (poll_ && Poll()); }

 private:
  bool Poll();  // asks poll_ once its interval has passed; one thread at a time
  const std::function<bool()> poll_;
  const int64_t poll_every_ns_;
  std::atomic<bool> stopped_{false};
  std::atomic<int64_t> next_poll_ns_{0};  // CLOCK_MONOTONIC_COARSE time of the next poll
};

/// Largest head_dim the CPU backend accepts.
inline constexpr int kMaxHeadDim = 256;

/// Empty string when the CPU backend can run p, else a message naming the offending field.
std::string supported(const AttentionParams& p);

/// Exact attention by tiled online softmax with fp32 accumulation (fp16/bf16/fp32 inputs;
/// output in the input dtype). Writes p.o and, if non-null, p.lse.
/// Requires supported(p).empty(). pool == nullptr runs on the calling thread.
void attention_forward(const AttentionParams& p, ThreadPool* pool);
/// The same, stopping early when `stop` (may be null) asks: then false, and O and LSE are
/// partly written and must not be used.
bool attention_forward(const AttentionParams& p, ThreadPool* pool, StopSignal* stop);

}  // namespace flashserve::kernels::cpu
