// cpu::ThreadPool: fixed workers sharing a FIFO of parallel_for jobs. Each job hands out indices
// through an atomic counter, so concurrent callers (and nested calls) share the workers and every
// caller makes progress on its own job even when all workers are busy elsewhere. A job whose fn
// says stop hands out no more indices (a cancelled request frees the workers at once).
// fn must not throw: an exception escaping a worker thread ends the process (std::terminate).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "flashserve/kernels/cpu_attention.h"

namespace flashserve::kernels::cpu {
namespace {

struct Job {
  const std::function<bool(int64_t)>* fn = nullptr;  // owned by the caller, alive until done
  int64_t n = 0;
  std::atomic<int64_t> next{0};      // next index to hand out
  std::atomic<int64_t> finished{0};  // indices whose fn call has returned, or skipped
  std::mutex mu;
  std::condition_variable done_cv;

  // Runs indices until none are left. Safe to call from any number of threads.
  void work() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      int64_t done = 1;
      // fn said stop: the indices not handed out yet never will be; they count as finished.
      if (!(*fn)(i)) done += std::max<int64_t>(0, n - next.exchange(n));
      if (finished.fetch_add(done) + done == n) {
        std::lock_guard<std::mutex> lock(mu);
        done_cv.notify_all();
      }
    }
  }
};

}  // namespace

struct ThreadPool::Impl {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Job>> jobs;  // jobs that may still have indices to hand out
  bool stop = false;
  std::vector<std::thread> workers;

  void remove(const std::shared_ptr<Job>& job) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = std::find(jobs.begin(), jobs.end(), job);
    if (it != jobs.end()) jobs.erase(it);
  }

  void worker_loop() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || !jobs.empty(); });
        if (stop) return;
        job = jobs.front();
      }
      job->work();
      remove(job);  // exhausted: nobody needs to look at it again
    }
  }
};

ThreadPool::ThreadPool(int num_threads) : impl_(std::make_unique<Impl>()) {
  if (num_threads <= 0)
    num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  // The calling thread of parallel_for is one of the num_threads. A thread that cannot start
  // (std::system_error: the process's or the system's thread limit, memory for its stack) ends the
  // pool's growth, not the process: the pool runs with the workers it has (num_threads() says).
  for (int t = 1; t < num_threads; ++t) {
    try {
      impl_->workers.emplace_back([this] { impl_->worker_loop(); });
    } catch (const std::system_error& e) {
      std::fprintf(stderr, "cpu::ThreadPool: %d of %d threads started, no more could (%s)\n", t,
                   num_threads, e.what());
      break;
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  for (std::thread& t : impl_->workers) t.join();
}

int ThreadPool::num_threads() const { return static_cast<int>(impl_->workers.size()) + 1; }

void ThreadPool::parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  parallel_for_while(n, [&fn](int64_t i) {
    fn(i);
    return true;
  });
}

void ThreadPool::parallel_for_while(int64_t n, const std::function<bool(int64_t)>& fn) {
  if (n <= 0) return;
  if (n == 1 || impl_->workers.empty()) {
    for (int64_t i = 0; i < n; ++i) {
      if (!fn(i)) return;
    }
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->jobs.push_back(job);
  }
  impl_->cv.notify_all();
  job->work();
  impl_->remove(job);
  std::unique_lock<std::mutex> lock(job->mu);
  job->done_cv.wait(lock, [&] { return job->finished.load() == n; });
}

}  // namespace flashserve::kernels::cpu
