// Stopping a running CPU forward pass (cpu::StopSignal): a request nobody waits for any more must
// free the threads within milliseconds, however large it is, and a stop that never fires must
// change nothing. Sizes are picked so that the unstopped passes take seconds on 2 cores.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "flashserve/kernels/cpu_attention.h"
#include "flashserve/kernels/float_convert.h"
#include "stop_timing.h"

namespace flashserve::kernels {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// A stopped pass must return within this of the stop (the service's bound is ~100 ms).
constexpr milliseconds kPrompt{100};

// q [1, seqlen_q, 1, d], k = v [1, seqlen_k, 1, d], random, contiguous.
struct Inputs {
  AttentionParams p;
  std::vector<char> q, kv, o;
  std::vector<float> lse;

  // random == false: zeros (the time does not depend on the values; filling 16M keys does).
  Inputs(DType dtype, int seqlen_q, int seqlen_k, int d, bool random = true) {
    p = make_contiguous_params(dtype, 1, seqlen_q, seqlen_k, 1, 1, d, false, 0.5f);
    const int64_t q_elements = int64_t{seqlen_q} * d, k_elements = int64_t{seqlen_k} * d;
    q.resize(size_t(q_elements) * dtype_size(dtype));
    kv.resize(size_t(k_elements) * dtype_size(dtype));
    o.assign(q.size(), 0);
    lse.assign(size_t(seqlen_q), 0.f);
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    for (int64_t i = 0; random && i < q_elements; ++i)
      store_element(q.data(), i, dtype, normal(rng));
    for (int64_t i = 0; random && i < k_elements; ++i)
      store_element(kv.data(), i, dtype, normal(rng));
    p.q = q.data();
    p.k = p.v = kv.data();
    p.o = o.data();
    p.lse = lse.data();
  }
};

milliseconds since(Clock::time_point start) {
  return std::chrono::duration_cast<milliseconds>(Clock::now() - start);
}

// Threads that may compute a pass: the pool's two and the calling thread.
constexpr int kComputeThreads = 3;

// A stop asked for from another thread `after` the pass started: whether the pass returned
// promptly after it (stop_timing.h: measured from the stop itself, not from when the stopper
// meant to wake).
::testing::AssertionResult stopped_promptly(const AttentionParams& p, cpu::ThreadPool* pool,
                                            milliseconds after, bool* finished) {
  cpu::StopSignal stop;
  test::StopMark asked;
  std::thread stopper([&] {
    std::this_thread::sleep_for(after);
    asked = test::StopMark();
    stop.request();
  });
  *finished = cpu::attention_forward(p, pool, &stop);
  const test::StopMark returned;
  stopper.join();
  return test::StoppedPromptly(asked, returned, kPrompt, kComputeThreads);
}

// 200k x 200k keys (fp32, d 4: the 19 MB request of the issue at half the length): ~15 s
// unstopped on 2 cores. Stopped between its 3125 query blocks and inside them.
TEST(CpuAttentionStop, LongPassStopsPromptly) {
  Inputs in(DType::kFloat32, 200000, 200000, 4);
  cpu::ThreadPool pool(2);
  for (cpu::ThreadPool* p : {&pool, static_cast<cpu::ThreadPool*>(nullptr)}) {
    bool finished = true;
    EXPECT_TRUE(stopped_promptly(in.p, p, milliseconds(50), &finished))
        << (p ? "pool" : "calling thread");
    EXPECT_FALSE(finished);
  }
}

// One query block against 16M keys: a single task of ~0.6 s. Only the check between key tiles
// can stop it in time.
TEST(CpuAttentionStop, OneHugeQueryBlockStopsBetweenKeyTiles) {
  Inputs in(DType::kBFloat16, 64, 16 << 20, 4, /*random=*/false);
  bool finished = true;
  EXPECT_TRUE(stopped_promptly(in.p, nullptr, milliseconds(20), &finished));
  EXPECT_FALSE(finished);
}

// The poll (a deadline here) is read at most once per interval, whatever the thread count.
TEST(CpuAttentionStop, PollsTheConditionAtMostOncePerInterval) {
  Inputs in(DType::kFloat32, 100000, 100000, 4);
  cpu::ThreadPool pool(2);
  std::atomic<int> polls{0};
  const Clock::time_point start = Clock::now();
  cpu::StopSignal stop(
      [&] {
        polls.fetch_add(1);
        return since(start) >= milliseconds(200);
      },
      /*poll_every_ns=*/5'000'000);
  test::StopMark due;  // the condition turns true 200 ms in
  std::thread marker([&] {
    std::this_thread::sleep_until(start + milliseconds(200));
    due = test::StopMark();
  });
  EXPECT_FALSE(cpu::attention_forward(in.p, &pool, &stop));
  const test::StopMark returned;
  const milliseconds took = since(start);
  marker.join();
  EXPECT_TRUE(test::StoppedPromptly(due, returned, kPrompt, kComputeThreads));
  EXPECT_GE(polls.load(), 2);
  EXPECT_LE(polls.load(), took / milliseconds(5) + 2);
}

// A stop that never fires leaves the result bit for bit as without one; a pool that ran a
// stopped pass computes the next one in full.
TEST(CpuAttentionStop, UnfiredStopChangesNothingAndThePoolStaysUsable) {
  Inputs in(DType::kFloat16, 700, 900, 64);
  cpu::ThreadPool pool(2);
  cpu::attention_forward(in.p, &pool);
  const std::vector<char> expected_o = in.o;
  const std::vector<float> expected_lse = in.lse;

  Inputs big(DType::kFloat32, 200000, 200000, 4);
  bool finished = true;
  EXPECT_TRUE(stopped_promptly(big.p, &pool, milliseconds(10), &finished));
  ASSERT_FALSE(finished);

  std::fill(in.o.begin(), in.o.end(), 0);
  std::fill(in.lse.begin(), in.lse.end(), 0.f);
  cpu::StopSignal never([] { return false; });
  EXPECT_TRUE(cpu::attention_forward(in.p, &pool, &never));
  EXPECT_EQ(in.o, expected_o);
  EXPECT_EQ(std::memcmp(in.lse.data(), expected_lse.data(), sizeof(float) * in.lse.size()), 0);
}

TEST(ThreadPool, ParallelForWhileStopsHandingOutIndices) {
  for (int threads : {1, 2, 4}) {
    cpu::ThreadPool pool(threads);
    constexpr int64_t kN = 10'000'000;
    std::vector<std::atomic<uint8_t>> hits(kN);
    std::atomic<int64_t> calls{0};
    pool.parallel_for_while(kN, [&](int64_t i) {
      hits[size_t(i)].fetch_add(1);
      calls.fetch_add(1);
      return i < 100;
    });
    // Each thread may have taken one index before it saw the stop.
    EXPECT_LE(calls.load(), 101 + threads) << threads << " threads";
    for (int64_t i = 0; i <= 100; ++i) ASSERT_EQ(hits[size_t(i)].load(), 1) << i;
    // The pool still runs a whole job afterwards.
    std::atomic<int64_t> all{0};
    pool.parallel_for(1000, [&](int64_t) { all.fetch_add(1); });
    EXPECT_EQ(all.load(), 1000);
  }
}

}  // namespace
}  // namespace flashserve::kernels
