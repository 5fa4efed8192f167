// The server's malloc replacement (server/memory/malloc_interpose.cc, linked into this test as into
// the server): before an arena is installed everything is glibc's; afterwards read-buffer-sized
// malloc and operator new come from the arena, other sizes and calloc do not, and free, realloc
// (grow, shrink, to zero), reallocarray and malloc_usable_size handle both kinds of block; the
// memalign family goes through the replacement to the real allocator; with a foreign allocator
// preloaded (the ctest malloc_interpose_jemalloc_test runs this binary under Debian's jemalloc)
// the arena is refused and every entry point still works.
#include <malloc.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "memory/receive_arena.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr size_t kReadBuffer = (64 << 10) + 40;

// The calls must not be optimized away (the compiler may pair a malloc with its free).
void* volatile g_sink;
void* Malloc(size_t n) { return g_sink = std::malloc(n); }
// Called through pointers so that the compiler does not reason about (and warn on) pointers
// passed to realloc that these tests use afterwards on purpose.
void* (*volatile Realloc)(void*, size_t) = std::realloc;
void* (*volatile ReallocArray)(void*, size_t, size_t) = reallocarray;

bool ForeignAllocatorPreloaded() {
  const char* preload = std::getenv("LD_PRELOAD");
  const std::string p = preload != nullptr ? preload : "";
  return p.find("jemalloc") != std::string::npos || p.find("tcmalloc") != std::string::npos;
}

// Runs first (before the next test installs an arena on glibc).
TEST(MallocInterposeAllocator, ArenaRefusedExactlyWhenTheAllocatorIsForeign) {
  if (!ForeignAllocatorPreloaded()) {
    EXPECT_EQ(ReceiveArena::InstallRefusal(), nullptr);
    return;
  }
  ASSERT_NE(ReceiveArena::InstallRefusal(), nullptr);
  EXPECT_TRUE(ReceiveArena::InstallOnHeap(size_t(64) << 20).ok());  // the server runs on...
  EXPECT_EQ(ReceiveArena::Installed(), nullptr);                     // ...without the arena
  // Blocks of every entry point go back through free without glibc seeing them (before the fix:
  // "free(): invalid pointer" at the first aligned block).
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, 64, kReadBuffer), 0);
  std::free(aligned);
  std::free(memalign(4096, 100));
  std::free(aligned_alloc(256, 4096));
  std::free(valloc(kReadBuffer));
  std::free(pvalloc(10));
  void* p = Malloc(kReadBuffer);
  EXPECT_GE(malloc_usable_size(p), kReadBuffer);
  std::free(ReallocArray(p, 3, kReadBuffer));
}

TEST(MallocInterpose, ServesReadBuffersFromTheInstalledArenaOnly) {
  // Before: glibc's.
  void* before = Malloc(kReadBuffer);
  ASSERT_NE(before, nullptr);
  ASSERT_EQ(ReceiveArena::Installed(), nullptr);

  ASSERT_TRUE(ReceiveArena::InstallOnHeap(size_t(64) << 20).ok());
  ReceiveArena* arena = ReceiveArena::Installed();
  ASSERT_NE(arena, nullptr);
  EXPECT_FALSE(arena->Owns(before));
  std::free(before);  // a glibc block freed while an arena exists goes back to glibc

  const int64_t used0 = arena->used_bytes();
  char* p = static_cast<char*>(Malloc(kReadBuffer));
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(arena->Owns(p));
  EXPECT_GT(arena->used_bytes(), used0);
  EXPECT_EQ(malloc_usable_size(p), arena->UsableSize(p));
  for (size_t i = 0; i < kReadBuffer; ++i) p[i] = char(i * 7);

  // Other sizes, calloc and aligned allocations are glibc's; malloc_usable_size still works.
  void* small = Malloc(1000);
  void* huge = Malloc(size_t(8) << 20);
  auto* zeroed = static_cast<unsigned char*>(std::calloc(1, kReadBuffer));
  void* aligned = nullptr;
  ASSERT_EQ(posix_memalign(&aligned, 4096, kReadBuffer), 0);
  for (void* q : {small, huge, static_cast<void*>(zeroed), aligned}) {
    ASSERT_NE(q, nullptr);
    EXPECT_FALSE(arena->Owns(q));
  }
  EXPECT_GE(malloc_usable_size(huge), size_t(8) << 20);
  for (size_t i = 0; i < kReadBuffer; i += 4093) EXPECT_EQ(zeroed[i], 0);
  std::free(small);
  std::free(huge);
  std::free(zeroed);
  std::free(aligned);

  // operator new (std::vector) reaches malloc.
  {
    auto v = std::make_unique<std::vector<char>>(kReadBuffer);
    EXPECT_TRUE(arena->Owns(v->data()));
  }

  // realloc within the block keeps it; beyond, moves the bytes and frees the block.
  EXPECT_EQ(Realloc(p, kReadBuffer - 1000), p);
  char* grown = static_cast<char*>(Realloc(p, size_t(300) << 10));
  ASSERT_NE(grown, nullptr);
  EXPECT_NE(grown, p);
  for (size_t i = 0; i < kReadBuffer; i += 997) ASSERT_EQ(grown[i], char(i * 7)) << i;
  char* beyond = static_cast<char*>(Realloc(grown, size_t(16) << 20));  // to glibc
  ASSERT_NE(beyond, nullptr);
  EXPECT_FALSE(arena->Owns(beyond));
  for (size_t i = 0; i < kReadBuffer; i += 997) ASSERT_EQ(beyond[i], char(i * 7)) << i;
  std::free(beyond);

  // reallocarray: overflow is ENOMEM and leaves the block alone; realloc to 0 frees it.
  void* q = Malloc(kReadBuffer);
  ASSERT_TRUE(arena->Owns(q));
  errno = 0;
  EXPECT_EQ(ReallocArray(q, SIZE_MAX / 2, 4), nullptr);
  EXPECT_EQ(errno, ENOMEM);
  EXPECT_EQ(Realloc(q, 0), nullptr);
  EXPECT_EQ(arena->used_bytes(), used0);

  // An exhausted arena is no limit: glibc serves.
  std::vector<void*> blocks;
  for (size_t n = 0; n < (size_t(80) << 20) / kReadBuffer; ++n) blocks.push_back(Malloc(kReadBuffer));
  size_t in_arena = 0;
  for (void* b : blocks) {
    ASSERT_NE(b, nullptr);
    in_arena += arena->Owns(b) ? 1 : 0;
  }
  EXPECT_GT(in_arena, 0u);
  EXPECT_LT(in_arena, blocks.size());
  EXPECT_GT(arena->misses(), 0);
  for (void* b : blocks) std::free(b);
  EXPECT_EQ(arena->used_bytes(), used0);
}

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// memalign, posix_memalign, aligned_alloc, valloc, pvalloc: aligned, writable, sized, never in the
// arena (installed on glibc by MallocInterpose above, refused under jemalloc), freed and
// reallocated through the replacement.
TEST(MallocInterposeAligned, MemalignFamilyGoesToTheRealAllocator) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  // ctest runs each test in its own process: install the arena here unless an earlier test of
  // this process did (InstallOnHeap refuses, and installs nothing, under a foreign allocator).
  if (ReceiveArena::Installed() == nullptr) {
    (void)ReceiveArena::InstallOnHeap(size_t(64) << 20);
  }
  ReceiveArena* arena = ReceiveArena::Installed();
  EXPECT_EQ(arena == nullptr, ForeignAllocatorPreloaded());
  std::vector<std::pair<void*, size_t>> blocks;
  for (size_t alignment : {size_t(16), size_t(64), size_t(4096), size_t(1) << 16}) {
    for (size_t size : {size_t(1), size_t(1000), kReadBuffer, size_t(3) << 20}) {
      void* m = memalign(alignment, size);
      void* pm = nullptr;
      ASSERT_EQ(posix_memalign(&pm, alignment, size), 0);
      void* aa = aligned_alloc(alignment, (size + alignment - 1) / alignment * alignment);
      for (void* q : {m, pm, aa}) {
        ASSERT_NE(q, nullptr);
        EXPECT_TRUE(Aligned(q, alignment)) << alignment;
        EXPECT_GE(malloc_usable_size(q), size);
        blocks.push_back({q, size});
      }
    }
  }
  blocks.push_back({valloc(kReadBuffer), kReadBuffer});
  blocks.push_back({pvalloc(page + 1), 2 * page});
  blocks.push_back({pvalloc(0), page});
  for (auto [q, size] : blocks) {
    ASSERT_NE(q, nullptr);
    if (arena != nullptr) {
      EXPECT_FALSE(arena->Owns(q));
    }
    std::memset(q, 0xab, size);
  }
  EXPECT_TRUE(Aligned(blocks[blocks.size() - 3].first, page));
  EXPECT_GE(malloc_usable_size(blocks[blocks.size() - 2].first), 2 * page);
  // Errors as glibc reports them.
  int sentinel = 0;
  void* untouched = &sentinel;
  void* out = untouched;
  EXPECT_EQ(posix_memalign(&out, 24, 100), EINVAL);
  EXPECT_EQ(posix_memalign(&out, 2, 100), EINVAL);  // less than a pointer
  EXPECT_EQ(out, untouched);
  void* rounded = memalign(24, 100);  // glibc rounds the alignment up to a power of two
  ASSERT_NE(rounded, nullptr);
  EXPECT_TRUE(Aligned(rounded, 32));
  blocks.push_back({rounded, 100});
  errno = 0;
  EXPECT_EQ(memalign(SIZE_MAX, 100), nullptr);
  EXPECT_EQ(errno, EINVAL);
  // realloc of an aligned block keeps its bytes.
  auto* grown = static_cast<unsigned char*>(Realloc(blocks[0].first, size_t(1) << 20));
  ASSERT_NE(grown, nullptr);
  EXPECT_EQ(grown[0], 0xab);
  blocks[0].first = grown;
  for (auto [q, size] : blocks) std::free(q);
}

}  // namespace
}  // namespace flashserve
