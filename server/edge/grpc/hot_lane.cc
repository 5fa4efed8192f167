#include "edge/grpc/hot_lane.h"

#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FLASHSERVE_CPU_RELAX() _mm_pause()
#else
#define FLASHSERVE_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace flashserve {

HotLane::HotLane(absl::Duration spin) : spin_(spin), thread_([this] { Loop(); }) {}

HotLane::~HotLane() {
  // Wait for a job being handed over or run, then close the lane to new ones.
  for (int expected = kFree; !state_.compare_exchange_weak(expected, kExiting);
       expected = kFree) {
    std::this_thread::yield();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake_.notify_all();
  }
  thread_.join();
}

bool HotLane::TryRun(absl::AnyInvocable<void()>& job) {
  int expected = kFree;
  if (!state_.compare_exchange_strong(expected, kClaimed)) return false;
  job_ = std::move(job);
  // Sequentially consistent with the lane's "sleeping_ = true, then check state_": one of the
  // two sides sees the other's write, so a job is never left behind a sleeping lane.
  state_.store(kReady);
  if (sleeping_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_.notify_one();
  }
  return true;
}

void HotLane::Loop() {
  using Clock = std::chrono::steady_clock;
  const auto spin = absl::ToChronoNanoseconds(spin_);
  for (;;) {
    const auto spin_end = Clock::now() + spin;
    int state = state_.load(std::memory_order_acquire);
    for (int polls = 0; state != kReady && state != kExiting; ++polls) {
      FLASHSERVE_CPU_RELAX();
      if ((polls & 63) == 63 && Clock::now() >= spin_end) {
        std::unique_lock<std::mutex> lock(mu_);
        sleeping_.store(true);
        wake_.wait(lock, [this] {
          const int s = state_.load();
          return s == kReady || s == kExiting;
        });
        sleeping_.store(false);
      }
      state = state_.load(std::memory_order_acquire);
    }
    if (state == kExiting) return;
    absl::AnyInvocable<void()> job = std::move(job_);
    job_ = nullptr;
    job();
    job = nullptr;  // whatever the job holds goes before the lane takes the next one
    state_.store(kFree, std::memory_order_release);
  }
}

}  // namespace flashserve
