// HeapRetention: glibc keeps a big request's freed receive buffers while big requests keep coming,
// and trims as usual once they stop (checked through the heap's size, mallinfo2().arena).
#include "common/heap_retention.h"

#include <malloc.h>

#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr size_t kChunk = 64 << 10;  // gRPC's read chunk (server/edge/grpc_edge.cc)

// Allocates and frees `bytes` of 64 KiB chunks, as one request's receive buffers; returns the size
// of the main heap afterwards (what glibc did not give back to the system).
size_t KeptAfterFreeing(size_t bytes) {
  std::vector<void*> chunks;
  chunks.reserve(bytes / kChunk + 1);  // no reallocation in between: it would pin the heap's top
  for (size_t n = 0; n < bytes; n += kChunk) {
    chunks.push_back(malloc(kChunk));
    static_cast<char*>(chunks.back())[0] = 1;  // touch it, as recv would
  }
  for (auto it = chunks.rbegin(); it != chunks.rend(); ++it) free(*it);
  return mallinfo2().arena;
}

bool GlibcTunable() {
  // Sanitizer allocators ignore mallopt; this test is about glibc's.
  return mallopt(M_TRIM_THRESHOLD, HeapRetention::kGlibcDefaultTrimThreshold) == 1;
}

TEST(HeapRetention, BigRequestsKeepTheirBuffersSmallTrafficTrims) {
  if (!GlibcTunable()) GTEST_SKIP() << "not glibc's malloc (sanitizer build?)";
  HeapRetention retention(int64_t{64} << 20, absl::Milliseconds(100));
  EXPECT_FALSE(retention.retaining());
  EXPECT_LT(KeptAfterFreeing(size_t{32} << 20), size_t{8} << 20) << "glibc's default trims";

  retention.Observe(HeapRetention::kBigRequestBytes);
  EXPECT_TRUE(retention.retaining());
  EXPECT_GE(KeptAfterFreeing(size_t{32} << 20), size_t{32} << 20) << "kept for the next request";

  retention.Observe(4 << 20);  // small traffic within `hold`: still retaining
  EXPECT_TRUE(retention.retaining());
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  retention.Observe(4 << 20);  // no big request for `hold`: back to glibc's default
  EXPECT_FALSE(retention.retaining());
  EXPECT_LT(KeptAfterFreeing(kChunk), size_t{8} << 20) << "the kept memory goes back";
}

TEST(HeapRetention, ZeroNeverRetains) {
  HeapRetention retention(0, absl::Seconds(10));
  retention.Observe(int64_t{1} << 30);
  EXPECT_FALSE(retention.retaining());
}

}  // namespace
}  // namespace flashserve
