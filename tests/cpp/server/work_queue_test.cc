// WorkQueue (server/common/work_queue.h): tasks run on its threads in arrival order, a task
// that waits holds only its own thread, the queue refuses past its capacity, and destruction
// runs what is still queued.
#include "common/work_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace flashserve {
namespace {

using namespace std::chrono_literals;

TEST(WorkQueue, RunsTasksOffTheCallersThreadInArrivalOrder) {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  {
    WorkQueue queue(1, 100);
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(queue.TrySubmit([&, i] {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(i);
        ran_on.push_back(std::this_thread::get_id());
      }));
    }
  }  // runs what is left, joins
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[size_t(i)], i);
  for (std::thread::id id : ran_on) EXPECT_NE(id, std::this_thread::get_id());
}

TEST(WorkQueue, AWaitingTaskHoldsOnlyItsThread) {
  std::promise<void> release, other_ran;
  std::shared_future<void> released = release.get_future().share();
  WorkQueue queue(2, 10);
  ASSERT_TRUE(queue.TrySubmit([released] { released.wait(); }));
  ASSERT_TRUE(queue.TrySubmit([&] { other_ran.set_value(); }));
  EXPECT_EQ(other_ran.get_future().wait_for(10s), std::future_status::ready)
      << "the second thread did not run the next task while the first waited";
  release.set_value();
}

TEST(WorkQueue, RefusesPastItsCapacityAndTakesMoreOnceTasksRun) {
  std::atomic<int> ran{0};  // before the queue: its destructor runs the last task
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> started;
  WorkQueue queue(1, 3);
  ASSERT_TRUE(queue.TrySubmit([&, released] {
    started.set_value();
    released.wait();
  }));
  started.get_future().wait();  // the thread holds the first task: the queue is empty
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(queue.TrySubmit([&] { ++ran; })) << i;
  EXPECT_FALSE(queue.TrySubmit([&] { ran += 100; })) << "a fourth waiting task was taken";
  release.set_value();
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (ran.load() < 3 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  EXPECT_EQ(ran.load(), 3);
  EXPECT_TRUE(queue.TrySubmit([&] { ++ran; }));
}

}  // namespace
}  // namespace flashserve
