// Pages of a fixed-size KV arena, as byte offsets. Every page size is a power of two and a page of
// size P starts at a multiple of P, so one launch over pages of one size addresses all of them as
// `base + index * P` (the paged decode kernel's layout: one pool pointer, one page stride).
//
// The arena is cut into slabs (kSlabBytes); a slab serves pages of one size at a time and goes back
// to the free slabs when its last page is freed, so sequences of different shapes share the
// arena without fragmenting it for good.
//
// Where a page goes: a sequence's layer is a run of pages read in token order, and the decode
// kernel reads a run that stays within few 2 MiB slabs as fast as dense K/V, one whose pages are
// scattered over the pool 1-3.5% slower (address translation per page;
// bench/results/kernels-decode-h200-2026-11-29-placement.md). So a run continues in its last page's
// slab while that has room, then in the slab of its size with the most free pages, and only then
// in an empty slab (which keeps the slabs of one size packed).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace flashserve::kvcache {

/// Not thread-safe: its owner (SequenceCache) serializes the calls.
class PageAllocator {
 public:
  static constexpr int64_t kSlabBytes = int64_t(2) << 20;  // 2 MiB: the largest page

  /// `capacity_bytes` is rounded down to whole slabs.
  explicit PageAllocator(int64_t capacity_bytes);

  int64_t capacity_bytes() const { return int64_t(slabs_.size()) * kSlabBytes; }
  int64_t used_bytes() const { return used_bytes_; }
  int64_t pages_used() const { return pages_used_; }
  int64_t free_slabs() const { return int64_t(free_slabs_.size()); }

  /// Whether `page_bytes` is a size pages can have: a power of two in [256, kSlabBytes].
  static bool ValidPageBytes(int64_t page_bytes);
  /// Pages of `page_bytes` that Allocate could hand out now.
  int64_t Available(int64_t page_bytes) const;
  /// Appends `count` page offsets to `offsets`, or returns false and takes nothing (all or
  /// nothing). The pages continue the run whose last page is at `after` (an offset Allocate
  /// handed out with this page_bytes; -1: a new run), in the order the run reads them.
  /// Requires ValidPageBytes(page_bytes).
  bool Allocate(int64_t page_bytes, int64_t count, std::vector<int64_t>* offsets,
                int64_t after = -1);
  /// Gives back pages that Allocate handed out with this page_bytes.
  void Free(int64_t page_bytes, const std::vector<int64_t>& offsets);

 private:
  struct Slab {
    int64_t page_bytes = 0;           // 0 while the slab is free
    int64_t free = 0;                 // its pages not handed out
    std::vector<uint64_t> free_bits;  // bit i: page i is free
  };
  struct SizeClass {
    int64_t free_pages = 0;  // in the slabs of this size
    // (free pages, slab) of this size's slabs with a free page: the roomiest is the last.
    std::set<std::pair<int64_t, int64_t>> by_room;
  };
  int64_t PagesPerSlab(int64_t page_bytes) const { return kSlabBytes / page_bytes; }
  // A slab of this size with a free page for a run whose last page is at `after`.
  int64_t SlabFor(int64_t page_bytes, int64_t after, SizeClass* size_class);
  void CarveSlab(int64_t page_bytes, SizeClass* size_class);
  // Appends up to `want` free pages of `slab` to `offsets`, those at or past page `from` first;
  // returns how many.
  int64_t TakePages(int64_t slab, int64_t from, int64_t want, SizeClass* size_class,
                    std::vector<int64_t>* offsets);
  void ReturnSlab(int64_t slab, SizeClass* size_class);

  std::vector<Slab> slabs_;
  std::vector<int64_t> free_slabs_;  // slab indices; the next one handed out is the last
  std::map<int64_t, SizeClass> classes_;
  int64_t used_bytes_ = 0;
  int64_t pages_used_ = 0;
};

}  // namespace flashserve::kvcache
