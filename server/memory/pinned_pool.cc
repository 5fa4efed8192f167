#include "memory/pinned_pool.h"

#include <mutex>
#include <new>
#include <utility>
#include <vector>

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

struct PinnedPool::Buffer::Core {
  Core(const PinnedPoolOptions& pool_options, std::unique_ptr<HostAllocator> host_allocator)
      : options(pool_options), allocator(std::move(host_allocator)) {}
  int ClassIndex(size_t class_bytes) const;
  /// Back on its class's free list, or freed: when that class keeps enough spares, or once the
  /// pool is gone (nothing would ever take it from the list again).
  void Release(void* data, size_t capacity);

  const PinnedPoolOptions options;
  const std::unique_ptr<HostAllocator> allocator;
  mutable std::mutex mu;
  std::vector<std::vector<void*>> free_lists;  // [class index]: cached buffers of that class
  PinnedPoolStats stats;                       // guarded by mu
  bool pool_destroyed = false;                 // guarded by mu
};

PinnedPool::Buffer& PinnedPool::Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    core_ = std::move(other.core_);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void PinnedPool::Buffer::reset() {
  if (data_ != nullptr) core_->Release(data_, capacity_);
  core_.reset();
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
    : core_(std::make_shared<Core>(options, std::move(allocator))) {
  // One list per class from min_class_bytes up to the largest power of two within the cap.
  for (size_t c = options.min_class_bytes; c != 0 && c <= options.capacity_bytes; c <<= 1) {
    core_->free_lists.emplace_back();
  }
}

PinnedPool::~PinnedPool() {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    core_->pool_destroyed = true;  // buffers still out are freed when returned
  }
  Trim();
}

const PinnedPoolOptions& PinnedPool::options() const { return core_->options; }

size_t PinnedPool::ClassSize(size_t bytes) const {
  const PinnedPoolOptions& options = core_->options;
  if (bytes > options.capacity_bytes) return 0;
  const size_t c =
      bytes <= options.min_class_bytes ? options.min_class_bytes : RoundUpPowerOfTwo(bytes);
  return c <= options.capacity_bytes ? c : 0;
}

int PinnedPool::Buffer::Core::ClassIndex(size_t class_bytes) const {
  int index = 0;
  for (size_t c = options.min_class_bytes; c < class_bytes; c <<= 1) ++index;
  return index;
}

PinnedPool::Buffer PinnedPool::Acquire(size_t bytes) {
  Core& core = *core_;
  const size_t class_bytes = ClassSize(bytes == 0 ? 1 : bytes);
  std::vector<std::pair<void*, size_t>> evicted;  // freed after the lock is dropped
  {
    std::lock_guard<std::mutex> lock(core.mu);
    if (class_bytes == 0 ||
        core.stats.used_bytes + int64_t(class_bytes) > int64_t(core.options.capacity_bytes)) {
      // Even with every cached buffer freed, the buffers in use leave no room.
      core.stats.refusals++;
      return Buffer();
    }
    std::vector<void*>& list = core.free_lists[size_t(core.ClassIndex(class_bytes))];
    if (!list.empty()) {
      void* data = list.back();
      list.pop_back();
      core.stats.used_bytes += int64_t(class_bytes);
      core.stats.reuses++;
      return Buffer(core_, data, class_bytes);
    }
    // Make room under the cap by freeing cached buffers, largest classes first (fewest frees).
    for (size_t i = core.free_lists.size();
         i-- > 0 &&
         core.stats.reserved_bytes + int64_t(class_bytes) > int64_t(core.options.capacity_bytes);) {
      const size_t size = core.options.min_class_bytes << i;
      while (!core.free_lists[i].empty() && core.stats.reserved_bytes + int64_t(class_bytes) >
                                                int64_t(core.options.capacity_bytes)) {
        evicted.emplace_back(core.free_lists[i].back(), size);
        core.free_lists[i].pop_back();
        core.stats.reserved_bytes -= int64_t(size);
        core.stats.evictions++;
      }
    }
    // Room is now guaranteed (used + class <= cap, nothing cached is left in the way): claim it
    // before allocating without the lock, so concurrent Acquires cannot overshoot the cap.
    core.stats.reserved_bytes += int64_t(class_bytes);
    core.stats.used_bytes += int64_t(class_bytes);
  }
  for (const auto& [pointer, size] : evicted) core.allocator->Free(pointer);
  void* data = core.allocator->Allocate(class_bytes);
  std::lock_guard<std::mutex> lock(core.mu);
  if (data == nullptr) {
    core.stats.reserved_bytes -= int64_t(class_bytes);
    core.stats.used_bytes -= int64_t(class_bytes);
    core.stats.refusals++;
    return Buffer();
  }
  core.stats.allocations++;
  return Buffer(core_, data, class_bytes);
}

void PinnedPool::Buffer::Core::Release(void* data, size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(mu);
    stats.used_bytes -= int64_t(capacity);
    std::vector<void*>& list = free_lists[size_t(ClassIndex(capacity))];
    if (!pool_destroyed &&
        (options.max_cached_per_class == 0 || list.size() < options.max_cached_per_class)) {
      list.push_back(data);
      return;
    }
    stats.reserved_bytes -= int64_t(capacity);
    stats.evictions++;
  }
  allocator->Free(data);  // that class already keeps enough spares, or the pool is gone
}

void PinnedPool::Trim() {
  Core& core = *core_;
  std::vector<std::vector<void*>> lists;
  {
    std::lock_guard<std::mutex> lock(core.mu);
    lists.resize(core.free_lists.size());
    lists.swap(core.free_lists);
    for (size_t i = 0; i < lists.size(); ++i) {
      core.stats.reserved_bytes -= int64_t(lists[i].size() * (core.options.min_class_bytes << i));
    }
  }
  for (const std::vector<void*>& list : lists) {
    for (void* pointer : list) core.allocator->Free(pointer);
  }
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->stats;
}

}  // namespace flashserve
