#include "memory/receive_arena.h"

#include <sys/mman.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace flashserve {

std::atomic<ReceiveArena*> ReceiveArena::installed_{nullptr};

namespace {
constexpr uint32_t kMagic = 0x66736172;  // "fsar": catches a foreign pointer in Free

struct BlockHeader {
  uint32_t magic;
  int32_t cls;
};
static_assert(sizeof(BlockHeader) <= ReceiveArena::kHeader);
}  // namespace

// Blocks are multiples of 64 bytes from a 64-byte aligned start, so every block is as aligned.
ReceiveArena::ReceiveArena(void* base, size_t bytes, bool page_locked)
    : begin_(std::min((reinterpret_cast<uintptr_t>(base) + kHeader - 1) / kHeader * kHeader,
                      reinterpret_cast<uintptr_t>(base) + bytes)),
      end_(reinterpret_cast<uintptr_t>(base) + bytes),
      page_locked_(page_locked),
      bump_(begin_) {}

void* ReceiveArena::Allocate(size_t bytes) {
  if (bytes < kMinRequest || bytes > kMaxRequest) return nullptr;
  int cls = 0;
  while (BlockBytes(cls) - kHeader < bytes) ++cls;
  char* block = nullptr;
  int taken = cls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_[cls] != nullptr) {
      block = reinterpret_cast<char*>(free_[cls]);
      free_[cls] = free_[cls]->next;
    } else if (end_ - bump_ >= BlockBytes(cls)) {
      block = reinterpret_cast<char*>(bump_);
      bump_ += BlockBytes(cls);
    } else {
      // The region is carved up: a free block of a larger class serves (it returns to its class).
      for (taken = cls + 1; taken < kClasses && free_[taken] == nullptr; ++taken) {
      }
      if (taken < kClasses) {
        block = reinterpret_cast<char*>(free_[taken]);
        free_[taken] = free_[taken]->next;
      }
    }
  }
  if (block == nullptr) {
    misses_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  auto* header = reinterpret_cast<BlockHeader*>(block);
  header->magic = kMagic;
  header->cls = taken;
  const int64_t used =
      used_.fetch_add(int64_t(BlockBytes(taken)), std::memory_order_relaxed) + int64_t(BlockBytes(taken));
  for (int64_t peak = peak_.load(std::memory_order_relaxed);
       used > peak && !peak_.compare_exchange_weak(peak, used, std::memory_order_relaxed);) {
  }
  return block + kHeader;
}

void ReceiveArena::Free(void* pointer) {
  char* block = static_cast<char*>(pointer) - kHeader;
  auto* header = reinterpret_cast<BlockHeader*>(block);
  if (header->magic != kMagic || header->cls < 0 || header->cls >= kClasses) __builtin_trap();
  const int cls = header->cls;
  header->magic = 0;  // a second Free of the same block traps
  used_.fetch_sub(int64_t(BlockBytes(cls)), std::memory_order_relaxed);
  auto* node = reinterpret_cast<FreeBlock*>(block);
  std::lock_guard<std::mutex> lock(mu_);
  node->next = free_[cls];
  free_[cls] = node;
}

absl::Status ReceiveArena::InstallOnHeap(size_t bytes) {
  if (Installed() != nullptr) return absl::OkStatus();
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", bytes, " bytes"));
  }
  Install(new ReceiveArena(base, bytes, /*page_locked=*/false));
  return absl::OkStatus();
}

size_t ReceiveArena::UsableSize(const void* pointer) const {
  const auto* header = reinterpret_cast<const BlockHeader*>(static_cast<const char*>(pointer) - kHeader);
  return BlockBytes(header->cls) - kHeader;
}

}  // namespace flashserve
