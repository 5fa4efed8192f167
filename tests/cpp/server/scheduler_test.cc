// Scheduler: bounded queue, every accepted job runs once, refusal when full or stopping.
#include "runtime/scheduler.h"

#include <atomic>
#include <future>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

std::unique_ptr<Scheduler> MakeScheduler(int capacity, int workers) {
  SchedulerOptions options;
  options.queue_capacity = capacity;
  options.num_workers = workers;
  absl::StatusOr<std::unique_ptr<Scheduler>> s = Scheduler::Create(options);
  EXPECT_TRUE(s.ok()) << s.status();
  return std::move(*s);
}

TEST(Scheduler, RejectsBadOptions) {
  EXPECT_FALSE(Scheduler::Create({0, 1}).ok());
  EXPECT_FALSE(Scheduler::Create({4, 0}).ok());
}

TEST(Scheduler, RunsEveryAcceptedJobOnce) {
  auto scheduler = MakeScheduler(1000, 3);
  std::atomic<int> runs{0};
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(scheduler->Submit([&runs] { runs.fetch_add(1); }).ok());
  }
  ASSERT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(runs.load(), 500);
}

TEST(Scheduler, FullQueueIsResourceExhausted) {
  auto scheduler = MakeScheduler(2, 1);
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> started{0};
  // One job occupies the worker...
  ASSERT_TRUE(scheduler
                  ->Submit([gate, &started] {
                    started++;
                    gate.wait();
                  })
                  .ok());
  while (started.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // ...two fill the queue, the next is refused at once.
  ASSERT_TRUE(scheduler->Submit([] {}).ok());
  ASSERT_TRUE(scheduler->Submit([] {}).ok());
  EXPECT_EQ(scheduler->queue_depth(), 2);
  EXPECT_EQ(scheduler->running(), 1);
  absl::Status refused = scheduler->Submit([] { ADD_FAILURE() << "refused job ran"; });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(scheduler->WaitIdle(absl::Now() + absl::Milliseconds(20)));
  release.set_value();
  EXPECT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(scheduler->Submit([] {}).ok());  // room again
}

TEST(Scheduler, StopAcceptingIsUnavailableButRunsQueued) {
  auto scheduler = MakeScheduler(8, 1);
  std::atomic<int> runs{0};
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(scheduler
                    ->Submit([&runs] {
                      std::this_thread::sleep_for(std::chrono::milliseconds(2));
                      runs++;
                    })
                    .ok());
  scheduler->StopAccepting();
  EXPECT_EQ(scheduler->Submit([] {}).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));
  EXPECT_EQ(runs.load(), 5);
}

TEST(Scheduler, DestructorRunsAcceptedJobs) {
  std::atomic<int> runs{0};
  {
    auto scheduler = MakeScheduler(16, 2);
    for (int i = 0; i < 16; ++i) ASSERT_TRUE(scheduler->Submit([&runs] { runs++; }).ok());
  }
  EXPECT_EQ(runs.load(), 16);
}

}  // namespace
TEST(Scheduler, RunsInlineOnlyWhenAWorkerWouldBeIdle) {
  auto scheduler = MakeScheduler(4, 1);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  ASSERT_TRUE(scheduler->SubmitOrRunInline([&] { ran_on = std::this_thread::get_id(); }).ok());
  EXPECT_EQ(ran_on, caller);  // idle: ran before SubmitOrRunInline returned, on this thread

  // The only worker busy: the next job is queued for it, not run here.
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<bool> started{false};
  ASSERT_TRUE(scheduler->Submit([&] { started = true; gate.wait(); }).ok());
  while (!started.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::promise<std::thread::id> second;
  ASSERT_TRUE(scheduler->SubmitOrRunInline([&] { second.set_value(std::this_thread::get_id()); }).ok());
  EXPECT_EQ(scheduler->queue_depth(), 1);
  release.set_value();
  EXPECT_NE(second.get_future().get(), caller);
  ASSERT_TRUE(scheduler->WaitIdle(absl::Now() + absl::Seconds(10)));

  scheduler->StopAccepting();
  EXPECT_EQ(scheduler->SubmitOrRunInline([] {}).code(), absl::StatusCode::kUnavailable);
}

}  // namespace flashserve
