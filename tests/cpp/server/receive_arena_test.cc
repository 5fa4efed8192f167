// ReceiveArena over ordinary memory: size classes and bounds, reuse of freed blocks, exhaustion
// (nullptr, counted, recovers after a free), larger free blocks serving smaller requests once the
// region is carved up, usage/peak accounting, many threads allocating, writing and freeing
// without two live blocks overlapping, double and invalid frees (also racing), and fork() while
// other threads hold the arena's lock.
#include "memory/receive_arena.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr size_t kBlock0 = ReceiveArena::kMinBlock + ReceiveArena::kSlack;  // the smallest block
constexpr size_t kReadBuffer = (64 << 10) + 40;  // what gRPC 1.51 mallocs per socket read

struct Region {
  explicit Region(size_t bytes) : memory(bytes) {}
  std::vector<char> memory;
  char* data() { return memory.data(); }
  size_t size() const { return memory.size(); }
};

TEST(ReceiveArena, ServesReadBufferSizesOnly) {
  Region region(size_t(64) << 20);
  ReceiveArena arena(region.data(), region.size(), /*page_locked=*/false);
  EXPECT_EQ(arena.Allocate(ReceiveArena::kMinRequest - 1), nullptr);
  EXPECT_EQ(arena.Allocate(ReceiveArena::kMaxRequest + 1), nullptr);
  EXPECT_EQ(arena.misses(), 0);  // out of range is not a miss: the arena never serves those

  void* p = arena.Allocate(kReadBuffer);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(arena.Owns(p));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_GE(arena.UsableSize(p), kReadBuffer);
  EXPECT_LT(arena.UsableSize(p), 2 * kReadBuffer);  // the smallest class that fits
  EXPECT_TRUE(arena.Contains(p, arena.UsableSize(p)));
  EXPECT_FALSE(arena.Contains(p, region.size()));
  std::memset(p, 0x5a, kReadBuffer);

  void* big = arena.Allocate(ReceiveArena::kMaxRequest);
  ASSERT_NE(big, nullptr);
  EXPECT_GE(arena.UsableSize(big), ReceiveArena::kMaxRequest);
  EXPECT_EQ(arena.used_bytes(), int64_t(kBlock0 + ReceiveArena::kMaxRequest + ReceiveArena::kHeader));
  arena.Free(p);
  arena.Free(big);
  EXPECT_EQ(arena.used_bytes(), 0);
  EXPECT_EQ(arena.peak_bytes(), int64_t(kBlock0 + ReceiveArena::kMaxRequest + ReceiveArena::kHeader));
  EXPECT_FALSE(arena.Owns(region.data() + region.size()));
  int outside = 0;
  EXPECT_FALSE(arena.Owns(&outside));
}

TEST(ReceiveArena, FreedBlocksAreReused) {
  Region region(size_t(8) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  void* a = arena.Allocate(kReadBuffer);
  arena.Free(a);
  EXPECT_EQ(arena.Allocate(kReadBuffer), a);
}

TEST(ReceiveArena, FullArenaMissesAndRecoversAfterAFree) {
  Region region(3 * kBlock0 + 100);
  ReceiveArena arena(region.data(), region.size(), false);
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) blocks.push_back(arena.Allocate(kReadBuffer));
  for (void* b : blocks) ASSERT_NE(b, nullptr);
  EXPECT_EQ(arena.Allocate(kReadBuffer), nullptr);
  EXPECT_EQ(arena.Allocate(2 * kReadBuffer), nullptr);  // a bigger class does not fit either
  EXPECT_EQ(arena.misses(), 2);
  arena.Free(blocks[1]);
  EXPECT_EQ(arena.Allocate(kReadBuffer), blocks[1]);
}

TEST(ReceiveArena, ALargerFreeBlockServesOnceTheRegionIsCarvedUp) {
  const size_t block1 = 2 * ReceiveArena::kMinBlock + ReceiveArena::kSlack;
  Region region(block1 + 63);  // room for one block of the second class (after aligning)
  ReceiveArena arena(region.data(), region.size(), false);
  void* large = arena.Allocate(ReceiveArena::kMinBlock + ReceiveArena::kSlack);  // needs class 1
  ASSERT_NE(large, nullptr);
  arena.Free(large);
  void* small = arena.Allocate(kReadBuffer);  // class 0 is empty and nothing is left to carve
  EXPECT_EQ(small, large);
  EXPECT_EQ(arena.used_bytes(), int64_t(block1));  // accounted as the block it really is
  arena.Free(small);                                // back to its own class...
  EXPECT_EQ(arena.Allocate(ReceiveArena::kMinBlock + ReceiveArena::kSlack), large);  // ...here
}

TEST(ReceiveArenaDeathTest, DoubleFreeTraps) {
  Region region(size_t(1) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  void* p = arena.Allocate(kReadBuffer);
  arena.Free(p);
  EXPECT_DEATH(arena.Free(p), "");
}

TEST(ReceiveArena, InvalidFreesAreRefused) {
  Region region(size_t(1) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  char* p = static_cast<char*>(arena.Allocate(kReadBuffer));
  ASSERT_NE(p, nullptr);
  EXPECT_FALSE(arena.TryFree(p + 64));     // inside the block: no block starts there
  EXPECT_FALSE(arena.TryFree(p + 1));      // not even aligned
  EXPECT_FALSE(arena.TryFree(region.data() + region.size() - 64));  // never handed out
  int outside = 0;
  EXPECT_FALSE(arena.TryFree(&outside));
  EXPECT_TRUE(arena.TryFree(p));
  EXPECT_FALSE(arena.TryFree(p));          // the second free of the same block
  EXPECT_EQ(arena.UsableSize(p), 0u);      // a freed block has no usable bytes
  EXPECT_EQ(arena.used_bytes(), 0);
}

// Threads released together free the same block: exactly one succeeds, every other is refused
// (Free would trap), and the block is on its free list once (two allocations get two blocks).
TEST(ReceiveArena, RacingDoubleFreesExactlyOneWins) {
  Region region(size_t(8) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  constexpr int kThreads = 4, kRounds = 200;
  for (int round = 0; round < kRounds; ++round) {
    void* p = arena.Allocate(kReadBuffer);
    ASSERT_NE(p, nullptr);
    std::atomic<int> ready{0}, wins{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&] {
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();
        if (arena.TryFree(p)) wins.fetch_add(1);
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_EQ(wins.load(), 1) << "round " << round;
    void* a = arena.Allocate(kReadBuffer);
    void* b = arena.Allocate(kReadBuffer);
    ASSERT_NE(a, b);
    arena.Free(a);
    arena.Free(b);
  }
  EXPECT_EQ(arena.used_bytes(), 0);
}

TEST(ReceiveArenaDeathTest, RacingDoubleFreeTrapsTheLoser) {
  Region region(size_t(1) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  void* p = arena.Allocate(kReadBuffer);
  EXPECT_DEATH(
      {
        std::thread a([&] { arena.Free(p); });
        std::thread b([&] { arena.Free(p); });
        a.join();
        b.join();
      },
      "double free or invalid pointer");
}

// fork() from a process whose installed arena is busy on other threads: every child allocates
// and frees from the arena and exits. Without the fork handlers a child forked while another
// thread held the lock would hang (caught by the deadline below).
TEST(ReceiveArena, ForkWhileOtherThreadsUseTheInstalledArena) {
  ASSERT_TRUE(ReceiveArena::InstallOnHeap(size_t(32) << 20).ok());
  ReceiveArena* arena = ReceiveArena::Installed();
  ASSERT_NE(arena, nullptr);
  std::atomic<bool> stop{false};
  std::vector<std::thread> users;
  for (int t = 0; t < 3; ++t) {
    users.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
        if (void* p = arena->Allocate(kReadBuffer)) arena->Free(p);
      }
    });
  }
  constexpr int kForks = 200;
  int hung = 0, failed = 0;
  for (int i = 0; i < kForks; ++i) {
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      void* p = arena->Allocate(kReadBuffer);
      if (p == nullptr) _exit(3);
      std::memset(p, 1, kReadBuffer);
      _exit(arena->TryFree(p) ? 0 : 4);
    }
    int status = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (waitpid(child, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(child, SIGKILL);
        waitpid(child, &status, 0);
        ++hung;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (hung > 0) break;  // one is enough (without the handlers about a third of the forks hang)
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  stop = true;
  for (auto& th : users) th.join();
  EXPECT_EQ(hung, 0);
  EXPECT_EQ(failed, 0);
}

TEST(ReceiveArena, ThreadsGetDisjointBlocks) {
  Region region(size_t(48) << 20);
  ReceiveArena arena(region.data(), region.size(), false);
  constexpr int kThreads = 8, kRounds = 400;
  std::vector<std::thread> threads;
  std::atomic<int> corrupt{0}, served{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(uint32_t(t) * 7919u + 1);
      std::uniform_int_distribution<size_t> size(ReceiveArena::kMinRequest, size_t(600) << 10);
      std::vector<std::pair<unsigned char*, size_t>> live;
      for (int r = 0; r < kRounds; ++r) {
        const size_t n = size(rng);
        auto* p = static_cast<unsigned char*>(arena.Allocate(n));
        if (p != nullptr) {
          std::memset(p, (t * 31 + r) & 0xff, n);
          live.push_back({p, n});
          served++;
        }
        if (live.size() > 6 || (p == nullptr && !live.empty())) {
          auto [q, m] = live.front();
          const unsigned char want = q[0];
          for (size_t i = 0; i < m; i += 997) {
            if (q[i] != want) corrupt++;
          }
          if (q[m - 1] != want) corrupt++;
          arena.Free(q);
          live.erase(live.begin());
        }
      }
      for (auto [q, m] : live) arena.Free(q);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(corrupt.load(), 0);
  EXPECT_GT(served.load(), kThreads * kRounds / 2);
  EXPECT_EQ(arena.used_bytes(), 0);
  EXPECT_LE(arena.peak_bytes(), int64_t(region.size()));
}

}  // namespace
}  // namespace flashserve
