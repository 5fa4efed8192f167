// One thread that keeps itself running between jobs, so the next job starts on a warm core.
//
// Why: gRPC hands each request to whichever of its threads is free, nearly always a different
// one on a different core than the last request's. On the GPU hosts a small request's path
// (parse, one 384 KiB copy, seven CUDA calls) then runs ~2.5x slower than on a core that just ran
// it: 8 threads taking turns in a bare CUDA program need 62 us to queue the same work that one
// thread queues in 24 (bench/service/cuda_launch_floor.cu). A request handed to a lane that spins
// between jobs runs warm.
//
// The lane holds at most one job: TryRun fails while it is busy, and the caller runs the job
// itself. After each job the lane polls for the next for `spin` (one core busy while traffic
// flows), then sleeps until TryRun wakes it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"

namespace flashserve {

class HotLane {
 public:
  explicit HotLane(absl::Duration spin);
  /// Runs a job already handed over, then joins the thread.
  ~HotLane();
  HotLane(const HotLane&) = delete;
  HotLane& operator=(const HotLane&) = delete;

  /// Hands `job` to the lane and returns true, or returns false (job untouched) if the lane is
  /// running or holding another job, or shutting down.
  bool TryRun(absl::AnyInvocable<void()>& job);

 private:
  enum State : int { kFree, kClaimed, kReady, kExiting };
  void Loop();

  const absl::Duration spin_;
  std::atomic<int> state_{kFree};
  absl::AnyInvocable<void()> job_;  // written by the claimer (kClaimed), read by the lane (kReady)
  std::atomic<bool> sleeping_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace flashserve
