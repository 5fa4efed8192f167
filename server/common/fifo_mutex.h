// A mutex that hands itself to its waiters in the order they asked (a ticket lock). std::mutex
// lets a thread that just unlocked take it again before a sleeping waiter wakes; with eight
// clients sharing the KV store's launch slot, that starved some of them for milliseconds (p99
// 2-14 ms against p50 0.3-0.7 ms, bench/results/service-h100-2026-11-25-decode-inplace.md;
// with this mutex 1.1-1.5 ms, bench/results/service-h200-2026-11-28-decode-inflight.md).
// Meets BasicLockable, so std::lock_guard / std::unique_lock work with it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace flashserve {

class FifoMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> guard(mu_);
    const uint64_t ticket = next_ticket_++;
    turn_.wait(guard, [&] { return serving_ == ticket; });
  }

  void unlock() {
    {
      std::lock_guard<std::mutex> guard(mu_);
      ++serving_;
    }
    turn_.notify_all();  // the next ticket's holder is among them; the others sleep again
  }

  /// Threads inside lock() that do not hold the mutex yet (for tests).
  int64_t waiters() const {
    std::lock_guard<std::mutex> guard(mu_);
    const uint64_t outstanding = next_ticket_ - serving_;  // the holder's ticket and the waiters'
    return outstanding == 0 ? 0 : int64_t(outstanding) - 1;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable turn_;
  uint64_t next_ticket_ = 0;  // the ticket the next lock() takes
  uint64_t serving_ = 0;      // the ticket that holds (or may take) the mutex
};

}  // namespace flashserve
