#include "memory/pinned_pool.h"

#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flashserve {

void* HeapAllocator::Allocate(size_t bytes) {
  return ::operator new(bytes, std::align_val_t(64), std::nothrow);
}

void HeapAllocator::Free(void* pointer) { ::operator delete(pointer, std::align_val_t(64)); }

namespace {

size_t RoundUpPowerOfTwo(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

}  // namespace

PinnedPool::Buffer& PinnedPool::Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void PinnedPool::Buffer::reset() {
  if (data_ != nullptr) pool_->Release(data_, capacity_);
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

absl::StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(
    const PinnedPoolOptions& options, std::unique_ptr<HostAllocator> allocator) {
  if (allocator == nullptr) return absl::InvalidArgumentError("pinned pool: no allocator");
  if (options.min_class_bytes < 1 || options.min_class_bytes > (size_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pinned pool: min_class_bytes out of range: ", options.min_class_bytes));
  }
  PinnedPoolOptions normalized = options;
  normalized.min_class_bytes = RoundUpPowerOfTwo(options.min_class_bytes);
  return std::unique_ptr<PinnedPool>(new PinnedPool(normalized, std::move(allocator)));
}

PinnedPool::PinnedPool(const PinnedPoolOptions& options, std::unique_ptr<HostAllocator> allocator)
    : options_(options), allocator_(std::move(allocator)) {
  // One list per class from min_class_bytes up to the largest power of two within the cap.
  for (size_t c = options_.min_class_bytes; c != 0 && c <= options_.capacity_bytes; c <<= 1) {
    free_lists_.emplace_back();
  }
}

PinnedPool::~PinnedPool() { Trim(); }

size_t PinnedPool::ClassSize(size_t bytes) const {
  if (bytes > options_.capacity_bytes) return 0;
  const size_t c = bytes <= options_.min_class_bytes ? options_.min_class_bytes
                                                     : RoundUpPowerOfTwo(bytes);
  return c <= options_.capacity_bytes ? c : 0;
}

int PinnedPool::ClassIndex(size_t class_bytes) const {
  int index = 0;
  for (size_t c = options_.min_class_bytes; c < class_bytes; c <<= 1) ++index;
  return index;
}

PinnedPool::Buffer PinnedPool::Acquire(size_t bytes) {
  const size_t class_bytes = ClassSize(bytes == 0 ? 1 : bytes);
  std::vector<std::pair<void*, size_t>> evicted;  // freed after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (class_bytes == 0 || stats_.used_bytes + int64_t(class_bytes) >
                                int64_t(options_.capacity_bytes)) {
      // Even with every cached buffer freed, the buffers in use leave no room.
      stats_.refusals++;
      return Buffer();
    }
    std::vector<void*>& list = free_lists_[size_t(ClassIndex(class_bytes))];
    if (!list.empty()) {
      void* data = list.back();
      list.pop_back();
      stats_.used_bytes += int64_t(class_bytes);
      stats_.reuses++;
      return Buffer(this, data, class_bytes);
    }
    // Make room under the cap by freeing cached buffers, largest classes first (fewest frees).
    for (size_t i = free_lists_.size();
         i-- > 0 && stats_.reserved_bytes + int64_t(class_bytes) >
                        int64_t(options_.capacity_bytes);) {
      const size_t size = options_.min_class_bytes << i;
      while (!free_lists_[i].empty() && stats_.reserved_bytes + int64_t(class_bytes) >
                                            int64_t(options_.capacity_bytes)) {
        evicted.emplace_back(free_lists_[i].back(), size);
        free_lists_[i].pop_back();
        stats_.reserved_bytes -= int64_t(size);
        stats_.evictions++;
      }
    }
    // Room is now guaranteed (used + class <= cap, nothing cached is left in the way): claim it
    // before allocating without the lock, so concurrent Acquires cannot overshoot the cap.
    stats_.reserved_bytes += int64_t(class_bytes);
    stats_.used_bytes += int64_t(class_bytes);
  }
  for (const auto& [pointer, size] : evicted) allocator_->Free(pointer);
  void* data = allocator_->Allocate(class_bytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (data == nullptr) {
    stats_.reserved_bytes -= int64_t(class_bytes);
    stats_.used_bytes -= int64_t(class_bytes);
    stats_.refusals++;
    return Buffer();
  }
  stats_.allocations++;
  return Buffer(this, data, class_bytes);
}

void PinnedPool::Release(void* data, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.used_bytes -= int64_t(capacity);
    std::vector<void*>& list = free_lists_[size_t(ClassIndex(capacity))];
    if (options_.max_cached_per_class == 0 || list.size() < options_.max_cached_per_class) {
      list.push_back(data);
      return;
    }
    stats_.reserved_bytes -= int64_t(capacity);
    stats_.evictions++;
  }
  allocator_->Free(data);  // that class already keeps enough spares
}

void PinnedPool::Trim() {
  std::vector<std::vector<void*>> lists;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lists.resize(free_lists_.size());
    lists.swap(free_lists_);
    for (size_t i = 0; i < lists.size(); ++i) {
      stats_.reserved_bytes -= int64_t(lists[i].size() * (options_.min_class_bytes << i));
    }
  }
  for (const std::vector<void*>& list : lists) {
    for (void* pointer : list) allocator_->Free(pointer);
  }
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace flashserve
