// FifoMutex (server/common/fifo_mutex.h): waiters get the mutex in the order they asked for it,
// and it excludes like a mutex.
#include "common/fifo_mutex.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace flashserve {
namespace {

// Spins until `mu` has `count` waiters (each thread below asks only once the previous waits).
void AwaitWaiters(const FifoMutex& mu, int64_t count) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (mu.waiters() < count) {
    ASSERT_LT(std::chrono::steady_clock::now(), until) << "waiters never reached " << count;
    std::this_thread::yield();
  }
}

TEST(FifoMutex, WaitersTakeItInArrivalOrder) {
  for (int round = 0; round < 20; ++round) {
    FifoMutex mu;
    std::mutex order_mu;
    std::vector<int> order;
    mu.lock();
    std::vector<std::thread> threads;
    for (int i = 0; i < 6; ++i) {
      threads.emplace_back([&, i] {
        std::lock_guard<FifoMutex> hold(mu);
        std::lock_guard<std::mutex> note(order_mu);
        order.push_back(i);
      });
      AwaitWaiters(mu, i + 1);
    }
    // The holder takes it straight back, as a thread serving a stream of calls would; a plain
    // mutex may let it in before the sleeping waiters.
    mu.unlock();
    mu.lock();
    order_mu.lock();
    order.push_back(-1);
    order_mu.unlock();
    mu.unlock();
    for (std::thread& t : threads) t.join();
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5, -1})) << "round " << round;
    EXPECT_EQ(mu.waiters(), 0);
  }
}

TEST(FifoMutex, Excludes) {
  FifoMutex mu;
  int64_t counter = 0;  // unsynchronized but for mu
  std::atomic<int> inside{0};
  std::atomic<bool> overlap{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        std::lock_guard<FifoMutex> hold(mu);
        if (inside.fetch_add(1) != 0) overlap = true;
        ++counter;
        inside.fetch_sub(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(overlap.load());
  EXPECT_EQ(counter, 8 * 2000);
  EXPECT_EQ(mu.waiters(), 0);
}

}  // namespace
}  // namespace flashserve
