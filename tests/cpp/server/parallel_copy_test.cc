// ParallelCopier: every byte lands where it should, whatever the piece sizes, helper count and
// number of concurrent callers.
#include "memory/parallel_copy.h"

#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

// Random pieces (empty, tiny, and several MiB) scattered into one destination buffer.
void CopyAndCheck(ParallelCopier* copier, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> sources;
  size_t total = 0;
  const int n = int(rng() % 12) + 1;
  for (int i = 0; i < n; ++i) {
    const size_t size = rng() % 3 == 0 ? rng() % 16 : rng() % (size_t{3} << 20);
    std::string s(size, '\0');
    for (char& c : s) c = char(rng());
    total += size;
    sources.push_back(std::move(s));
  }
  std::string dest(total + 64, '\x5a');
  std::vector<CopyPiece> pieces;
  size_t offset = 0;
  for (const std::string& s : sources) {
    pieces.push_back({dest.data() + offset, s.data(), s.size()});
    offset += s.size();
  }
  copier->Copy(pieces);
  std::string want;
  for (const std::string& s : sources) want += s;
  ASSERT_EQ(dest.substr(0, total), want) << "seed " << seed;
  EXPECT_EQ(dest.substr(total), std::string(64, '\x5a')) << "wrote past the end, seed " << seed;
}

TEST(ParallelCopier, CopiesExactlyWithAndWithoutHelpers) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  for (int helpers : {0, 1, 3}) {
    ParallelCopier copier(helpers, /*min_parallel_bytes=*/1 << 20);
    EXPECT_EQ(copier.helpers(), helpers);
    for (int i = 0; i < 8; ++i) CopyAndCheck(&copier, seed + uint64_t(i));
    copier.Copy({});  // nothing to do
  }
}

TEST(ParallelCopier, ConcurrentCallersShareTheHelpers) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(seed);
  ParallelCopier copier(2, /*min_parallel_bytes=*/1 << 16);
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int i = 0; i < 5; ++i) CopyAndCheck(&copier, seed * 31 + uint64_t(t * 100 + i));
    });
  }
  for (std::thread& t : callers) t.join();
}

}  // namespace
}  // namespace flashserve
