// HotLane: a job handed over runs exactly once on the lane's own thread; a busy lane refuses
// (leaving the job with the caller); a lane that went to sleep still wakes for the next job; the
// destructor runs a job already handed over.
#include "edge/grpc/hot_lane.h"

#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

// Hands `job` over, retrying while the lane is busy; returns the future of its completion.
std::future<std::thread::id> RunOnLane(HotLane* lane) {
  auto done = std::make_shared<std::promise<std::thread::id>>();
  std::future<std::thread::id> result = done->get_future();
  for (;;) {
    absl::AnyInvocable<void()> job = [done] { done->set_value(std::this_thread::get_id()); };
    if (lane->TryRun(job)) return result;
    EXPECT_TRUE(job) << "a refused job must stay with the caller";
    std::this_thread::yield();
  }
}

TEST(HotLane, RunsJobsOnItsOwnThread) {
  HotLane lane(absl::Milliseconds(5));
  std::thread::id lane_thread;
  for (int i = 0; i < 100; ++i) {
    std::future<std::thread::id> done = RunOnLane(&lane);
    ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    const std::thread::id id = done.get();
    EXPECT_NE(id, std::this_thread::get_id());
    if (i > 0) {
      EXPECT_EQ(id, lane_thread) << "one lane, one thread";
    }
    lane_thread = id;
  }
}

TEST(HotLane, BusyLaneRefusesAndLeavesTheJobWithTheCaller) {
  HotLane lane(absl::Milliseconds(5));
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> started{false};
  absl::AnyInvocable<void()> blocker = [&started, released] {
    started = true;
    released.wait();
  };
  ASSERT_TRUE(lane.TryRun(blocker));
  while (!started) std::this_thread::yield();
  int ran_here = 0;
  absl::AnyInvocable<void()> second = [&ran_here] { ++ran_here; };
  EXPECT_FALSE(lane.TryRun(second));
  ASSERT_TRUE(second);
  second();  // the caller's fallback
  EXPECT_EQ(ran_here, 1);
  release.set_value();
}

// With no spin the lane sleeps between jobs: every job must still be picked up (no lost wake-up
// between "going to sleep" and a job arriving), whatever the timing.
TEST(HotLane, SleepingLaneWakesForEveryJob) {
  for (int64_t spin_us : {0, 20}) {
    HotLane lane(absl::Microseconds(spin_us));
    std::mt19937 rng(spin_us + 7);
    for (int i = 0; i < 2000; ++i) {
      if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 50));
      std::future<std::thread::id> done = RunOnLane(&lane);
      ASSERT_EQ(done.wait_for(std::chrono::seconds(10)), std::future_status::ready)
          << "job " << i << " lost (spin " << spin_us << " us)";
    }
  }
}

TEST(HotLane, ConcurrentCallersEveryJobRunsOnce) {
  HotLane lane(absl::Microseconds(200));
  std::atomic<int64_t> ran{0}, inline_runs{0};
  std::vector<std::thread> callers;
  constexpr int kCallers = 4, kJobs = 5000;
  for (int t = 0; t < kCallers; ++t) {
    callers.emplace_back([&] {
      for (int i = 0; i < kJobs; ++i) {
        absl::AnyInvocable<void()> job = [&ran] { ran.fetch_add(1); };
        if (!lane.TryRun(job)) {
          job();  // what the edge does: run it on the calling thread
          inline_runs.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  // Jobs handed over may still be running: wait for every job to have run, once.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (ran.load() < kCallers * kJobs && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  EXPECT_EQ(ran.load(), kCallers * kJobs);
  EXPECT_GT(inline_runs.load(), 0) << "four callers never found the lane busy?";
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(ran.load(), kCallers * kJobs) << "a job ran twice";
}

TEST(HotLane, DestructorRunsAJobAlreadyHandedOver) {
  std::atomic<int> ran{0};
  {
    HotLane lane(absl::ZeroDuration());
    absl::AnyInvocable<void()> job = [&ran] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      ran.fetch_add(1);
    };
    ASSERT_TRUE(lane.TryRun(job));
  }
  EXPECT_EQ(ran.load(), 1);
}

}  // namespace
}  // namespace flashserve
