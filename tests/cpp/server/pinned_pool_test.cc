// PinnedPool with a fake (malloc) allocator: size classes, reuse without new allocations, the byte
// cap (eviction of cached buffers, refusal), allocator failure, and concurrent use.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "memory/pinned_pool.h"

namespace flashserve {
namespace {

constexpr size_t KiB = 1024;

/// malloc-backed; counts calls and tracks live blocks so leaks and double frees show.
class FakeAllocator final : public HostAllocator {
 public:
  struct Counters {
    std::atomic<int> allocations{0}, frees{0};
    std::atomic<bool> fail{false};
    std::mutex mu;
    std::set<void*> live;
  };
  explicit FakeAllocator(Counters* counters) : c_(counters) {}
  void* Allocate(size_t bytes) override {
    if (c_->fail.load()) return nullptr;
    void* p = std::malloc(bytes);
    std::memset(p, 0xab, bytes);  // touch every byte: ASan catches a class smaller than promised
    c_->allocations++;
    std::lock_guard<std::mutex> lock(c_->mu);
    c_->live.insert(p);
    return p;
  }
  void Free(void* p) override {
    c_->frees++;
    {
      std::lock_guard<std::mutex> lock(c_->mu);
      EXPECT_EQ(c_->live.erase(p), 1u) << "free of a block not allocated (or freed twice)";
    }
    std::free(p);
  }

 private:
  Counters* c_;
};

std::unique_ptr<PinnedPool> MakePool(FakeAllocator::Counters* counters, size_t capacity,
                                     size_t min_class = 64 * KiB) {
  PinnedPoolOptions options;
  options.capacity_bytes = capacity;
  options.min_class_bytes = min_class;
  auto pool = PinnedPool::Create(options, std::make_unique<FakeAllocator>(counters));
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

TEST(PinnedPool, SizeClassesArePowersOfTwoFromTheMinimum) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 64 << 20, 50 * KiB);  // the minimum is rounded up to 64 KiB
  EXPECT_EQ(pool->ClassSize(1), 64 * KiB);
  EXPECT_EQ(pool->ClassSize(64 * KiB), 64 * KiB);
  EXPECT_EQ(pool->ClassSize(64 * KiB + 1), 128 * KiB);
  EXPECT_EQ(pool->ClassSize(3 << 20), size_t{4} << 20);
  EXPECT_EQ(pool->ClassSize(64 << 20), size_t{64} << 20);
  EXPECT_EQ(pool->ClassSize((64 << 20) + 1), 0u);  // over the cap: no class
  PinnedPool::Buffer b = pool->Acquire(100 * KiB);
  ASSERT_TRUE(b);
  EXPECT_EQ(b.capacity(), 128 * KiB);
  std::memset(b.data(), 1, b.capacity());
  EXPECT_EQ(pool->stats().used_bytes, int64_t(128 * KiB));
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(128 * KiB));
}

TEST(PinnedPool, ReleasedBufferIsReusedWithoutAllocating) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 16 << 20);
  void* first = nullptr;
  {
    PinnedPool::Buffer b = pool->Acquire(200 * KiB);
    ASSERT_TRUE(b);
    first = b.data();
  }
  EXPECT_EQ(c.allocations.load(), 1);
  EXPECT_EQ(pool->stats().used_bytes, 0);
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(256 * KiB));  // kept, not freed
  PinnedPool::Buffer again = pool->Acquire(256 * KiB);           // same class
  ASSERT_TRUE(again);
  EXPECT_EQ(static_cast<void*>(again.data()), first);
  EXPECT_EQ(c.allocations.load(), 1);
  EXPECT_EQ(c.frees.load(), 0);
  EXPECT_EQ(pool->stats().reuses, 1);
  // Another class is a new allocation.
  PinnedPool::Buffer other = pool->Acquire(10 * KiB);
  ASSERT_TRUE(other);
  EXPECT_EQ(c.allocations.load(), 2);
}

TEST(PinnedPool, SparesPerClassAreCappedWhenAsked) {
  FakeAllocator::Counters c;
  PinnedPoolOptions options;
  options.capacity_bytes = 64 << 20;
  options.max_cached_per_class = 2;
  auto pool = std::move(*PinnedPool::Create(options, std::make_unique<FakeAllocator>(&c)));
  {
    std::vector<PinnedPool::Buffer> held;
    for (int i = 0; i < 5; ++i) held.push_back(pool->Acquire(100 * KiB));
    EXPECT_EQ(c.allocations.load(), 5);
  }  // all five released: two kept as spares, three freed
  EXPECT_EQ(c.frees.load(), 3);
  EXPECT_EQ(pool->stats().used_bytes, 0);
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(2 * 128 * KiB));
  PinnedPool::Buffer a = pool->Acquire(100 * KiB), b = pool->Acquire(100 * KiB);
  EXPECT_EQ(c.allocations.load(), 5);  // both spares reused
  PinnedPool::Buffer d = pool->Acquire(100 * KiB);
  EXPECT_EQ(c.allocations.load(), 6);
}

TEST(PinnedPool, MoveTransfersOwnership) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 1 << 20);
  PinnedPool::Buffer a = pool->Acquire(1);
  PinnedPool::Buffer b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  ASSERT_TRUE(b);
  EXPECT_EQ(pool->stats().used_bytes, int64_t(64 * KiB));
  b.reset();
  EXPECT_EQ(pool->stats().used_bytes, 0);
}

TEST(PinnedPool, CapRefusesWhenBuffersInUseLeaveNoRoom) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 1 << 20);  // 1 MiB
  PinnedPool::Buffer a = pool->Acquire(512 * KiB);
  PinnedPool::Buffer b = pool->Acquire(512 * KiB);
  ASSERT_TRUE(a && b);
  PinnedPool::Buffer c3 = pool->Acquire(1);
  EXPECT_FALSE(c3);
  EXPECT_FALSE(pool->Acquire((1 << 20) + 1));  // larger than the cap: never
  EXPECT_EQ(pool->stats().refusals, 2);
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(1 << 20));
  a.reset();
  EXPECT_TRUE(pool->Acquire(300 * KiB));  // the freed 512 KiB class serves it
  EXPECT_EQ(c.allocations.load(), 2);
}

TEST(PinnedPool, CachedBuffersOfOtherClassesAreEvictedToStayUnderTheCap) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 1 << 20);
  {
    std::vector<PinnedPool::Buffer> small;
    for (int i = 0; i < 16; ++i) small.push_back(pool->Acquire(64 * KiB));  // fills the cap
    for (const auto& b : small) ASSERT_TRUE(b);
  }
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(1 << 20));  // all cached
  PinnedPool::Buffer big = pool->Acquire(1 << 20);
  ASSERT_TRUE(big);
  EXPECT_EQ(pool->stats().evictions, 16);
  EXPECT_EQ(c.frees.load(), 16);
  EXPECT_EQ(pool->stats().reserved_bytes, int64_t(1 << 20));
  EXPECT_LE(pool->stats().reserved_bytes, int64_t(pool->options().capacity_bytes));
}

TEST(PinnedPool, AllocatorFailureIsARefusalAndLeavesTheBooksBalanced) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 1 << 20);
  c.fail = true;
  EXPECT_FALSE(pool->Acquire(100));
  EXPECT_EQ(pool->stats().used_bytes, 0);
  EXPECT_EQ(pool->stats().reserved_bytes, 0);
  c.fail = false;
  EXPECT_TRUE(pool->Acquire(100));
}

TEST(PinnedPool, ZeroCapacityDisablesThePool) {
  FakeAllocator::Counters c;
  auto pool = MakePool(&c, 0);
  EXPECT_FALSE(pool->Acquire(1));
  EXPECT_EQ(c.allocations.load(), 0);
}

TEST(PinnedPool, TrimAndDestructionFreeEverythingCached) {
  FakeAllocator::Counters c;
  {
    auto pool = MakePool(&c, 8 << 20);
    { PinnedPool::Buffer a = pool->Acquire(1), b = pool->Acquire(1 << 20); }
    PinnedPool::Buffer kept = pool->Acquire(3 << 20);
    pool->Trim();
    EXPECT_EQ(c.frees.load(), 2);
    EXPECT_EQ(pool->stats().reserved_bytes, int64_t(4 << 20));
  }
  EXPECT_EQ(c.allocations.load(), c.frees.load());
  EXPECT_TRUE(c.live.empty());
}

TEST(PinnedPool, ConcurrentUseStaysUnderTheCapAndBalances) {
  FakeAllocator::Counters c;
  constexpr size_t kCap = 4 << 20;
  auto pool = MakePool(&c, kCap);
  std::atomic<int64_t> max_reserved{0};
  std::atomic<int> got{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const size_t bytes = size_t(1 + (t * 7919 + i * 104729) % (1 << 20));
        PinnedPool::Buffer b = pool->Acquire(bytes);
        if (b) {
          got++;
          b.data()[0] = char(t);
          b.data()[bytes - 1] = char(i);
        }
        int64_t r = pool->stats().reserved_bytes, seen = max_reserved.load();
        while (r > seen && !max_reserved.compare_exchange_weak(seen, r)) {
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_GT(got.load(), 0);
  EXPECT_LE(max_reserved.load(), int64_t(kCap));
  const PinnedPoolStats s = pool->stats();
  EXPECT_EQ(s.used_bytes, 0);
  EXPECT_GT(s.reuses, 0);
  pool.reset();
  EXPECT_EQ(c.allocations.load(), c.frees.load());
}

}  // namespace
}  // namespace flashserve
