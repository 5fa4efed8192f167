#include "kvcache/page_allocator.h"

#include <algorithm>
#include <map>
#include <random>
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

// Where pages go (page_allocator.h): the decode kernel reads a layer whose pages stay in few 2 MiB
// slabs at dense speed and one scattered over the pool up to 3% slower.

constexpr int64_t kPage = kSlab / 8;  // 256 KiB: a d128, 8-head layer's K and V of 64 tokens

int64_t SlabOf(int64_t offset) { return offset / kSlab; }

// A pool whose every page was handed out one at a time and then about half of them freed in a
// random order (a server that has seen sequences come and go).
PageAllocator FragmentedPool(int slabs, std::mt19937* rng, std::vector<int64_t>* kept) {
  PageAllocator pages(slabs * kSlab);
  std::vector<int64_t> all;
  for (int i = 0; i < slabs * 8; ++i) EXPECT_TRUE(pages.Allocate(kPage, 1, &all));
  std::shuffle(all.begin(), all.end(), *rng);
  for (int64_t o : all) {
    if ((*rng)() % 2 == 0) {
      pages.Free(kPage, {o});
    } else {
      kept->push_back(o);
    }
  }
  return pages;
}

TEST(PageAllocatorPlacement, ARunOnAFragmentedPoolVisitsEachSlabOnceInAscendingOrder) {
  std::mt19937 rng(20261129);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> kept;
    PageAllocator pages = FragmentedPool(16, &rng, &kept);
    const int64_t free = pages.Available(kPage);
    std::vector<int64_t> run;
    ASSERT_TRUE(pages.Allocate(kPage, free, &run));  // a long prefix takes every free page
    std::set<int64_t> left;                          // slabs the run has moved on from
    for (size_t i = 1; i < run.size(); ++i) {
      if (SlabOf(run[i]) == SlabOf(run[i - 1])) {
        EXPECT_GT(run[i], run[i - 1]) << "trial " << trial << ": not ascending within a slab";
        continue;
      }
      EXPECT_TRUE(left.insert(SlabOf(run[i - 1])).second);
      EXPECT_EQ(left.count(SlabOf(run[i])), 0u) << "trial " << trial << ": came back to a slab";
    }
    EXPECT_EQ(pages.free_slabs(), 0);
  }
}

TEST(PageAllocatorPlacement, AGrowingRunStaysInItsSlabANewRunTakesTheRoomiest) {
  PageAllocator pages(2 * kSlab);
  std::vector<int64_t> a, b;
  ASSERT_TRUE(pages.Allocate(kPage, 3, &a));   // slab 0, pages 0-2
  ASSERT_TRUE(pages.Allocate(kPage, 12, &b));  // slab 0, pages 3-7, then slab 1, pages 0-6
  pages.Free(kPage, {b[0], b[2], b[5], b[6], b[7], b[8]});  // slab 0: 3 and 5 free; slab 1: 3 free
  ASSERT_TRUE(pages.Allocate(kPage, 1, &a, a.back()));
  EXPECT_EQ(a.back(), 3 * kPage) << "the run left its slab";
  ASSERT_TRUE(pages.Allocate(kPage, 1, &a, a.back()));
  EXPECT_EQ(a.back(), 5 * kPage);
  std::vector<int64_t> c;
  ASSERT_TRUE(pages.Allocate(kPage, 1, &c));  // slab 1 has 5 free pages, slab 0 none
  EXPECT_EQ(SlabOf(c[0]), 1);
  ASSERT_TRUE(pages.Allocate(kPage, 1, &a, a.back()));  // a's slab is full: the roomiest
  EXPECT_EQ(SlabOf(a.back()), 1);
}

// Placement does not spread a size over the arena: a new run fills the slabs of its size that have
// room before it takes an empty slab (which another page size may need).
TEST(PageAllocatorPlacement, RunsFillPartlyUsedSlabsBeforeTakingEmptyOnes) {
  PageAllocator pages(8 * kSlab);
  std::vector<int64_t> eight, more, two;
  ASSERT_TRUE(pages.Allocate(kPage, 8, &eight));  // one slab
  ASSERT_TRUE(pages.Allocate(kPage, 1, &more));   // a second one
  pages.Free(kPage, {eight[1], eight[4]});
  ASSERT_TRUE(pages.Allocate(kPage, 9, &two));  // 7 + 2 free pages in the two slabs
  EXPECT_EQ(pages.free_slabs(), 6) << "an empty slab was taken while others had room";
}

TEST(PageAllocator, FreeingAPageTwiceOrOneNeverHandedOutChangesNothing) {
  PageAllocator pages(2 * kSlab);
  std::vector<int64_t> a;
  ASSERT_TRUE(pages.Allocate(kPage, 2, &a));
  pages.Free(kPage, {a[0]});
  // Again; a page of a free slab; offsets outside the pool.
  pages.Free(kPage, {a[0], 7 * kSlab / 8 + kSlab, -kPage, 9 * kSlab});
  std::vector<int64_t> b;
  ASSERT_TRUE(pages.Allocate(kPage, 1, &b, 9 * kSlab));  // a hint outside the pool: a new run
  pages.Free(kPage, b);
  EXPECT_EQ(pages.pages_used(), 1);
  EXPECT_EQ(pages.used_bytes(), kPage);
  EXPECT_EQ(pages.Available(kPage), 15);
}

// Random runs taken and freed with every kind of hint: pages stay aligned and distinct, the counts
// stay right, Allocate fails only when Available says so, and an empty pool gives back every slab.
TEST(PageAllocator, RandomRunsKeepTheBooksStraight) {
  std::mt19937 rng(11);
  const int64_t sizes[] = {4096, 65536, kPage, kSlab};
  PageAllocator pages(24 * kSlab);
  std::map<int64_t, int64_t> owner_size;  // offset -> page bytes, of every page handed out
  std::vector<std::pair<int64_t, std::vector<int64_t>>> runs;
  for (int op = 0; op < 4000; ++op) {
    if (!runs.empty() && rng() % 3 == 0) {
      const size_t i = rng() % runs.size();
      pages.Free(runs[i].first, runs[i].second);
      for (int64_t o : runs[i].second) owner_size.erase(o);
      runs.erase(runs.begin() + i);
      continue;
    }
    const int64_t size = sizes[rng() % 4];
    const int64_t count = int64_t(rng() % 40);
    std::vector<int64_t> got;
    int64_t after = -1;
    for (const auto& [s, offsets] : runs) {
      if (s == size && !offsets.empty() && rng() % 2 == 0) after = offsets.back();
    }
    const bool room = pages.Available(size) >= count;
    ASSERT_EQ(pages.Allocate(size, count, &got, after), room);
    if (!room) continue;
    for (int64_t o : got) {
      ASSERT_EQ(o % size, 0);
      ASSERT_LE(o + size, pages.capacity_bytes());
      auto next = owner_size.lower_bound(o);
      ASSERT_TRUE(next == owner_size.end() || next->first >= o + size) << "overlap";
      if (next != owner_size.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, o) << "overlap";
      }
      owner_size[o] = size;
    }
    runs.emplace_back(size, std::move(got));
  }
  int64_t bytes = 0;
  for (const auto& [o, size] : owner_size) bytes += size;
  EXPECT_EQ(pages.used_bytes(), bytes);
  EXPECT_EQ(pages.pages_used(), int64_t(owner_size.size()));
  for (const auto& [size, offsets] : runs) pages.Free(size, offsets);
  EXPECT_EQ(pages.used_bytes(), 0);
  EXPECT_EQ(pages.free_slabs(), 24);
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
