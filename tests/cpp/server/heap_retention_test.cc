// HeapRetention: while big requests keep coming, gRPC-sized receive buffers come from the heap and
// stay there after they are freed; once they stop, such buffers are mmaps again and the heap is
// trimmed (checked through the main heap's size, mallinfo2().arena).
#include "memory/heap_retention.h"

#include <malloc.h>

#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr size_t kChunk = 1 << 20;  // within gRPC's read chunk sizes (server/edge/grpc/grpc_edge.cc)
constexpr int64_t kBaseMmapThreshold = 128 << 10;  // the server's --malloc_mmap_threshold_bytes
// Long enough that a loaded machine stalling this process (hundreds of ms) does not end retention
// between two steps of a test; the ends are polled for, not slept into.
constexpr absl::Duration kHold = absl::Seconds(2);

// Whether retention ended (and, with `trimmed`, the main heap shrank below 8 MiB) within 10 s: the
// thread that ends it runs on its own schedule, after `hold`.
bool EndsWithin10s(const HeapRetention& retention, bool trimmed) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!retention.retaining() && (!trimmed || mallinfo2().arena < (size_t{8} << 20))) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

// Allocates and frees `bytes` of 1 MiB chunks, as one request's receive buffers; returns the size
// of the main heap afterwards (what glibc kept rather than gave back to the system).
size_t HeapAfterFreeing(size_t bytes) {
  std::vector<void*> chunks;
  chunks.reserve(bytes / kChunk + 1);  // no reallocation in between: it would pin the heap's top
  for (size_t n = 0; n < bytes; n += kChunk) {
    chunks.push_back(malloc(kChunk));
    static_cast<char*>(chunks.back())[0] = 1;  // touch it, as recv would
  }
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) free(*it);
  return mallinfo2().arena;
}

// The server's startup setting; false where another allocator (a sanitizer's) ignores mallopt.
bool SetBaseThresholds() {
  return mallopt(M_MMAP_THRESHOLD, int(kBaseMmapThreshold)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, HeapRetention::kGlibcDefaultTrimThreshold) == 1;
}

TEST(HeapRetention, BigRequestsKeepTheirBuffersOtherwiseTheyAreMmaps) {
  if (!SetBaseThresholds()) GTEST_SKIP() << "not glibc's malloc (sanitizer build?)";
  HeapRetention retention(int64_t{64} << 20, kBaseMmapThreshold, kHold);
  EXPECT_FALSE(retention.retaining());
  EXPECT_LT(HeapAfterFreeing(size_t{32} << 20), size_t{8} << 20) << "mmaps, given back";

  retention.Observe(HeapRetention::kBigRequestBytes);
  EXPECT_TRUE(retention.retaining());
  EXPECT_GE(HeapAfterFreeing(size_t{32} << 20), size_t{32} << 20) << "kept for the next request";

  retention.Observe(4 << 20);  // smaller requests within `hold`: still retaining
  EXPECT_TRUE(retention.retaining());
  EXPECT_TRUE(EndsWithin10s(retention, false)) << "no big request for `hold`: back to the base";
  EXPECT_LT(HeapAfterFreeing(size_t{32} << 20), size_t{8} << 20) << "the kept memory goes back";
}

// A sequence's prefix arrives as message strings of 16 MiB each (8k tokens x 8 heads x d128 x
// 2 bytes): while retaining, they come from the heap too, and the next prefix reuses the pages.
TEST(HeapRetention, PrefixSizedStringsComeFromTheHeapWhileRetaining) {
  if (!SetBaseThresholds()) GTEST_SKIP() << "not glibc's malloc (sanitizer build?)";
  HeapRetention retention(int64_t{64} << 20, kBaseMmapThreshold, kHold);
  constexpr size_t kPrefixString = size_t{16} << 20;
  auto heap_after_one = [] {
    char* p = static_cast<char*>(malloc(kPrefixString));
    asm volatile("" : : "r"(p) : "memory");  // the compiler would drop a malloc/free pair
    p[kPrefixString - 1] = 1;
    free(p);
    return mallinfo2().arena;
  };
  EXPECT_LT(heap_after_one(), kPrefixString) << "an mmap of its own";
  retention.Observe(int64_t{32} << 20);  // a 32 MiB CreateSequence
  EXPECT_GE(heap_after_one(), kPrefixString) << "from the heap, kept for the next prefix";
}

// A decode step is far below kBigRequestBytes but asks for the same: its buffers stay on the heap
// while steps keep coming, and go back once they stop.
TEST(HeapRetention, RetainKeepsBuffersUntilHoldPassesWithoutOne) {
  if (!SetBaseThresholds()) GTEST_SKIP() << "not glibc's malloc (sanitizer build?)";
  HeapRetention retention(int64_t{64} << 20, kBaseMmapThreshold, kHold);
  retention.Observe(1 << 20);  // a small request alone changes nothing
  EXPECT_FALSE(retention.retaining());
  retention.Retain();
  EXPECT_TRUE(retention.retaining());
  EXPECT_GE(HeapAfterFreeing(size_t{8} << 20), size_t{8} << 20) << "kept for the next step";
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  retention.Retain();  // steps keep coming: `hold` counts from the last one
  std::this_thread::sleep_for(std::chrono::milliseconds(1200));
  EXPECT_TRUE(retention.retaining()) << "2.4 s after the first step, 1.2 s after the last";
  EXPECT_TRUE(EndsWithin10s(retention, false));
  EXPECT_LT(HeapAfterFreeing(size_t{32} << 20), size_t{8} << 20) << "the kept memory goes back";
}

// Nothing else has to come for retention to end: one decode step followed by traffic that never
// calls Observe (or by nothing) kept the heap's hundreds of MB until the next small request.
TEST(HeapRetention, EndsOnItsOwnAndGivesTheKeptHeapBack) {
  if (!SetBaseThresholds()) GTEST_SKIP() << "not glibc's malloc (sanitizer build?)";
  HeapRetention retention(int64_t{64} << 20, kBaseMmapThreshold, kHold);
  retention.Retain();
  EXPECT_GE(HeapAfterFreeing(size_t{32} << 20), size_t{32} << 20) << "kept for the next step";
  // No call of any kind meanwhile: given back without another malloc or free.
  EXPECT_TRUE(EndsWithin10s(retention, true)) << "heap " << mallinfo2().arena << " bytes";
}

TEST(HeapRetention, DisabledByZeroRetainOrDynamicMmapThreshold) {
  HeapRetention off(0, kBaseMmapThreshold, absl::Seconds(10));
  off.Observe(int64_t{1} << 30);
  off.Retain();
  EXPECT_FALSE(off.retaining());
  HeapRetention dynamic(int64_t{64} << 20, 0, absl::Seconds(10));
  dynamic.Observe(int64_t{1} << 30);
  dynamic.Retain();
  EXPECT_FALSE(dynamic.retaining());
}

}  // namespace
}  // namespace flashserve
