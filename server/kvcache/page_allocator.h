// Pages of a fixed-size KV arena, as byte offsets. Every page size is a power of two and a page of
// size P starts at a multiple of P, so one launch over pages of one size addresses all of them as
// `base + index * P` (the paged decode kernel's layout: one pool pointer, one page stride).
//
// The arena is cut into slabs (kSlabBytes); a slab serves pages of one size at a time and goes back
// to the free slabs when its last page is freed, so sequences of different shapes share the
// arena without fragmenting it for good.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

namespace flashserve::kvcache {

/// Not thread-safe: its owner (SequenceCache) serializes the calls.
class PageAllocator {
 public:
  static constexpr int64_t kSlabBytes = int64_t(2) << 20;  // 2 MiB: the largest page

  /// `capacity_bytes` is rounded down to whole slabs.
  explicit PageAllocator(int64_t capacity_bytes);

  int64_t capacity_bytes() const { return int64_t(slab_class_.size()) * kSlabBytes; }
  int64_t used_bytes() const { return used_bytes_; }
  int64_t pages_used() const { return pages_used_; }
  int64_t free_slabs() const { return int64_t(free_slabs_.size()); }

  /// Whether `page_bytes` is a size pages can have: a power of two in [256, kSlabBytes].
  static bool ValidPageBytes(int64_t page_bytes);
  /// Pages of `page_bytes` that Allocate could hand out now.
  int64_t Available(int64_t page_bytes) const;
  /// Appends `count` page offsets to `offsets`, or returns false and takes nothing (all or
  /// nothing). Requires ValidPageBytes(page_bytes).
  bool Allocate(int64_t page_bytes, int64_t count, std::vector<int64_t>* offsets);
  /// Gives back pages that Allocate handed out with this page_bytes.
  void Free(int64_t page_bytes, const std::vector<int64_t>& offsets);

 private:
  struct SizeClass {
    std::vector<int64_t> free_pages;  // offsets in slabs of this class
  };
  void CarveSlab(int64_t page_bytes, SizeClass* size_class);
  void ReturnSlab(int64_t slab, SizeClass* size_class);

  std::vector<int64_t> slab_class_;  // per slab: its page size, 0 when the slab is free
  std::vector<int64_t> slab_used_;   // per slab: pages handed out
  std::vector<int64_t> free_slabs_;  // slab indices
  std::map<int64_t, SizeClass> classes_;
  int64_t used_bytes_ = 0;
  int64_t pages_used_ = 0;
};

}  // namespace flashserve::kvcache
