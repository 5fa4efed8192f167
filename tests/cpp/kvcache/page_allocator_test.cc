#include "kvcache/page_allocator.h"

#include <set>

#include "gtest/gtest.h"

namespace flashserve::kvcache {
namespace {

constexpr int64_t kSlab = PageAllocator::kSlabBytes;

TEST(PageAllocator, PagesAreAlignedToTheirSizeAndDistinct) {
  PageAllocator pages(3 * kSlab + 12345);  // rounded down to 3 slabs
  EXPECT_EQ(pages.capacity_bytes(), 3 * kSlab);
  std::vector<int64_t> small, large;
  ASSERT_TRUE(pages.Allocate(4096, 700, &small));  // 512 per slab: two slabs
  ASSERT_TRUE(pages.Allocate(65536, 20, &large));  // one slab
  std::set<int64_t> seen;
  for (int64_t o : small) {
    EXPECT_EQ(o % 4096, 0);
    EXPECT_TRUE(seen.insert(o).second);
    EXPECT_LT(o + 4096, 3 * kSlab + 1);
  }
  for (int64_t o : large) {
    EXPECT_EQ(o % 65536, 0);
    for (int64_t b = o; b < o + 65536; b += 4096) EXPECT_EQ(seen.count(b), 0u) << "overlap";
  }
  EXPECT_EQ(pages.used_bytes(), 700 * 4096 + 20 * 65536);
  EXPECT_EQ(pages.pages_used(), 720);
}

TEST(PageAllocator, AllOrNothing) {
  PageAllocator pages(2 * kSlab);
  std::vector<int64_t> offsets;
  ASSERT_TRUE(pages.Allocate(kSlab / 4, 5, &offsets));
  EXPECT_EQ(pages.Available(kSlab / 4), 3);
  EXPECT_FALSE(pages.Allocate(kSlab / 4, 4, &offsets));
  EXPECT_EQ(offsets.size(), 5u);  // nothing appended
  EXPECT_EQ(pages.pages_used(), 5);
  EXPECT_TRUE(pages.Allocate(kSlab / 4, 3, &offsets));
  EXPECT_EQ(pages.Available(kSlab / 4), 0);
}

TEST(PageAllocator, AnEmptiedSlabServesAnotherSize) {
  PageAllocator pages(kSlab);
  std::vector<int64_t> a;
  ASSERT_TRUE(pages.Allocate(1024, 10, &a));
  EXPECT_EQ(pages.Available(kSlab), 0);  // the only slab holds 1 KiB pages now
  pages.Free(1024, a);
  EXPECT_EQ(pages.used_bytes(), 0);
  EXPECT_EQ(pages.free_slabs(), 1);
  std::vector<int64_t> b;
  ASSERT_TRUE(pages.Allocate(kSlab, 1, &b));
  EXPECT_EQ(b[0], 0);
}

TEST(PageAllocator, ValidPageBytes) {
  EXPECT_TRUE(PageAllocator::ValidPageBytes(256));
  EXPECT_TRUE(PageAllocator::ValidPageBytes(kSlab));
  EXPECT_FALSE(PageAllocator::ValidPageBytes(128));
  EXPECT_FALSE(PageAllocator::ValidPageBytes(3 * 1024));
  EXPECT_FALSE(PageAllocator::ValidPageBytes(2 * kSlab));
}

}  // namespace
}  // namespace flashserve::kvcache
