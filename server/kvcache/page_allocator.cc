#include "kvcache/page_allocator.h"

#include <algorithm>

namespace flashserve::kvcache {
namespace {

bool BitSet(const std::vector<uint64_t>& bits, int64_t i) {
  return (bits[size_t(i >> 6)] >> (i & 63)) & 1;
}

// The first set bit in [from, end), or -1.
int64_t FirstSetBit(const std::vector<uint64_t>& bits, int64_t from, int64_t end) {
  for (int64_t i = from; i < end;) {
    const uint64_t word = bits[size_t(i >> 6)] >> (i & 63);
    if (word != 0) {
      const int64_t at = i + __builtin_ctzll(word);
      return at < end ? at : -1;
    }
    i = (i | 63) + 1;  // the next word
  }
  return -1;
}

// The roomiest slab is by_room's last entry; among equally roomy ones the lowest index.
std::pair<int64_t, int64_t> RoomKey(int64_t free, int64_t slab) { return {free, -slab}; }

}  // namespace

PageAllocator::PageAllocator(int64_t capacity_bytes) {
  const int64_t slabs = std::max<int64_t>(0, capacity_bytes / kSlabBytes);
  slabs_.resize(size_t(slabs));
  // Highest index last popped first, so the arena fills from its start.
  for (int64_t s = slabs - 1; s >= 0; --s) free_slabs_.push_back(s);
}

bool PageAllocator::ValidPageBytes(int64_t page_bytes) {
  return page_bytes >= 256 && page_bytes <= kSlabBytes && (page_bytes & (page_bytes - 1)) == 0;
}

int64_t PageAllocator::Available(int64_t page_bytes) const {
  auto it = classes_.find(page_bytes);
  const int64_t loose = it == classes_.end() ? 0 : it->second.free_pages;
  return loose + free_slabs() * PagesPerSlab(page_bytes);
}

void PageAllocator::CarveSlab(int64_t page_bytes, SizeClass* size_class) {
  const int64_t index = free_slabs_.back();
  free_slabs_.pop_back();
  Slab& slab = slabs_[size_t(index)];
  const int64_t pages = PagesPerSlab(page_bytes);
  slab.page_bytes = page_bytes;
  slab.free = pages;
  slab.free_bits.assign(size_t((pages + 63) / 64), 0);
  for (int64_t i = 0; i < pages; ++i) slab.free_bits[size_t(i >> 6)] |= uint64_t(1) << (i & 63);
  size_class->free_pages += pages;
  size_class->by_room.insert(RoomKey(pages, index));
}

int64_t PageAllocator::SlabFor(int64_t page_bytes, int64_t after, SizeClass* size_class) {
  if (after >= 0 && after < capacity_bytes()) {
    const int64_t index = after / kSlabBytes;
    const Slab& slab = slabs_[size_t(index)];
    if (slab.page_bytes == page_bytes && slab.free > 0) return index;
  }
  if (size_class->by_room.empty()) CarveSlab(page_bytes, size_class);
  return -size_class->by_room.rbegin()->second;
}

int64_t PageAllocator::TakePages(int64_t index, int64_t from, int64_t want, SizeClass* size_class,
                                 std::vector<int64_t>* offsets) {
  Slab& slab = slabs_[size_t(index)];
  const int64_t pages = PagesPerSlab(slab.page_bytes);
  const int64_t take = std::min(want, slab.free);
  // Its free pages at and past `from` first, then those before (a run's pages ascend).
  for (int64_t n = 0, at = from; n < take; ++n) {
    int64_t page = FirstSetBit(slab.free_bits, at, pages);
    if (page < 0) page = FirstSetBit(slab.free_bits, 0, from);
    slab.free_bits[size_t(page >> 6)] &= ~(uint64_t(1) << (page & 63));
    offsets->push_back(index * kSlabBytes + page * slab.page_bytes);
    at = page + 1;
  }
  // One update of the slab's place in by_room for all of them.
  size_class->by_room.erase(RoomKey(slab.free, index));
  slab.free -= take;
  if (slab.free > 0) size_class->by_room.insert(RoomKey(slab.free, index));
  size_class->free_pages -= take;
  return take;
}

bool PageAllocator::Allocate(int64_t page_bytes, int64_t count, std::vector<int64_t>* offsets,
                             int64_t after) {
  if (count < 0 || Available(page_bytes) < count) return false;
  SizeClass& size_class = classes_[page_bytes];
  for (int64_t left = count; left > 0;) {
    const int64_t slab = SlabFor(page_bytes, after, &size_class);
    // In the run's slab, from the page after its last one (ascending addresses).
    const int64_t from =
        after >= 0 && after / kSlabBytes == slab ? (after % kSlabBytes) / page_bytes + 1 : 0;
    left -= TakePages(slab, from, left, &size_class, offsets);
    after = offsets->back();
  }
  used_bytes_ += count * page_bytes;
  pages_used_ += count;
  return true;
}

void PageAllocator::ReturnSlab(int64_t index, SizeClass* size_class) {
  Slab& slab = slabs_[size_t(index)];
  size_class->by_room.erase(RoomKey(slab.free, index));
  size_class->free_pages -= slab.free;
  slab = Slab{};
  free_slabs_.push_back(index);
}

void PageAllocator::Free(int64_t page_bytes, const std::vector<int64_t>& offsets) {
  SizeClass& size_class = classes_[page_bytes];
  // A layer's pages come in runs within slabs: by_room moves once per run of one slab.
  int64_t index = -1, freed = 0;
  auto settle = [&] {
    if (freed == 0) return;
    Slab& slab = slabs_[size_t(index)];
    size_class.by_room.erase(RoomKey(slab.free, index));
    slab.free += freed;
    size_class.free_pages += freed;
    used_bytes_ -= freed * page_bytes;
    pages_used_ -= freed;
    freed = 0;
    if (slab.free == PagesPerSlab(page_bytes)) {
      ReturnSlab(index, &size_class);
    } else {
      size_class.by_room.insert(RoomKey(slab.free, index));
    }
  };
  for (int64_t offset : offsets) {
    if (offset < 0 || offset >= capacity_bytes()) continue;  // never handed out
    if (offset / kSlabBytes != index) settle();
    index = offset / kSlabBytes;
    Slab& slab = slabs_[size_t(index)];
    const int64_t page = (offset % kSlabBytes) / page_bytes;
    if (slab.page_bytes != page_bytes || BitSet(slab.free_bits, page)) continue;  // not handed out
    slab.free_bits[size_t(page >> 6)] |= uint64_t(1) << (page & 63);
    ++freed;
  }
  settle();
}

}  // namespace flashserve::kvcache
