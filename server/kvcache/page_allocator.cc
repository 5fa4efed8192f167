#include "kvcache/page_allocator.h"

#include <algorithm>

namespace flashserve::kvcache {

PageAllocator::PageAllocator(int64_t capacity_bytes) {
  const int64_t slabs = std::max<int64_t>(0, capacity_bytes / kSlabBytes);
  slab_class_.assign(size_t(slabs), 0);
  slab_used_.assign(size_t(slabs), 0);
  // Highest index last popped first, so the arena fills from its start.
  for (int64_t s = slabs - 1; s >= 0; --s) free_slabs_.push_back(s);
}

bool PageAllocator::ValidPageBytes(int64_t page_bytes) {
  return page_bytes >= 256 && page_bytes <= kSlabBytes && (page_bytes & (page_bytes - 1)) == 0;
}

int64_t PageAllocator::Available(int64_t page_bytes) const {
  auto it = classes_.find(page_bytes);
  const int64_t loose = it == classes_.end() ? 0 : int64_t(it->second.free_pages.size());
  return loose + free_slabs() * (kSlabBytes / page_bytes);
}

void PageAllocator::CarveSlab(int64_t page_bytes, SizeClass* size_class) {
  const int64_t slab = free_slabs_.back();
  free_slabs_.pop_back();
  slab_class_[size_t(slab)] = page_bytes;
  const int64_t start = slab * kSlabBytes;
  // Pushed from the end, so pages are handed out in ascending order.
  for (int64_t offset = start + kSlabBytes - page_bytes; offset >= start; offset -= page_bytes) {
    size_class->free_pages.push_back(offset);
  }
}

bool PageAllocator::Allocate(int64_t page_bytes, int64_t count, std::vector<int64_t>* offsets) {
  if (count < 0 || Available(page_bytes) < count) return false;
  SizeClass& size_class = classes_[page_bytes];
  for (int64_t i = 0; i < count; ++i) {
    if (size_class.free_pages.empty()) CarveSlab(page_bytes, &size_class);
    const int64_t offset = size_class.free_pages.back();
    size_class.free_pages.pop_back();
    ++slab_used_[size_t(offset / kSlabBytes)];
    offsets->push_back(offset);
  }
  used_bytes_ += count * page_bytes;
  pages_used_ += count;
  return true;
}

void PageAllocator::ReturnSlab(int64_t slab, SizeClass* size_class) {
  const int64_t start = slab * kSlabBytes;
  std::vector<int64_t>& pages = size_class->free_pages;
  pages.erase(std::remove_if(pages.begin(), pages.end(),
                             [&](int64_t o) { return o >= start && o < start + kSlabBytes; }),
              pages.end());
  slab_class_[size_t(slab)] = 0;
  free_slabs_.push_back(slab);
}

void PageAllocator::Free(int64_t page_bytes, const std::vector<int64_t>& offsets) {
  SizeClass& size_class = classes_[page_bytes];
  for (int64_t offset : offsets) {
    const int64_t slab = offset / kSlabBytes;
    size_class.free_pages.push_back(offset);
    if (--slab_used_[size_t(slab)] == 0) ReturnSlab(slab, &size_class);
  }
  used_bytes_ -= int64_t(offsets.size()) * page_bytes;
  pages_used_ -= int64_t(offsets.size());
}

}  // namespace flashserve::kvcache
