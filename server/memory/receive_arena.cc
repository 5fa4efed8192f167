#include "memory/receive_arena.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace flashserve {

std::atomic<ReceiveArena*> ReceiveArena::installed_{nullptr};
std::atomic<const char*> ReceiveArena::refusal_{nullptr};

namespace {
// A block's state word. A live block's header says kLive; Free turns it to kFree under the lock,
// so a second Free of the block (or a pointer into the arena that is no block) finds no kLive.
constexpr uint32_t kLive = 0x66736172;  // "fsar"
constexpr uint32_t kFree = 0x66736166;  // "fsaf"
}  // namespace

struct ReceiveArena::BlockHeader {
  uint32_t state;
  int32_t cls;
  BlockHeader* next;  // the next free block of its class (while kFree)
};

// Blocks are multiples of 64 bytes from a 64-byte aligned start, so every block is as aligned.
ReceiveArena::ReceiveArena(void* base, size_t bytes, bool page_locked)
    : begin_(std::min((reinterpret_cast<uintptr_t>(base) + kHeader - 1) / kHeader * kHeader,
                      reinterpret_cast<uintptr_t>(base) + bytes)),
      end_(reinterpret_cast<uintptr_t>(base) + bytes),
      page_locked_(page_locked),
      bump_(begin_) {
  static_assert(sizeof(BlockHeader) <= kHeader);
}

void* ReceiveArena::Allocate(size_t bytes) {
  if (bytes < kMinRequest || bytes > kMaxRequest) return nullptr;
  int cls = 0;
  while (BlockBytes(cls) - kHeader < bytes) ++cls;
  BlockHeader* block = nullptr;
  int taken = cls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_[cls] == nullptr && end_ - bump_ >= BlockBytes(cls)) {
      block = reinterpret_cast<BlockHeader*>(bump_);
      bump_ += BlockBytes(cls);
      block->cls = cls;
    } else {
      // A free block of the class, or once the region is carved up, of a larger class (it
      // returns to its own class when freed).
      while (taken < kClasses && free_[taken] == nullptr) ++taken;
      if (taken < kClasses) {
        block = free_[taken];
        free_[taken] = block->next;
      }
    }
    if (block != nullptr) block->state = kLive;
  }
  if (block == nullptr) {
    misses_.fetch_add(1, std::memory_order_relaxed);
    return nullptr;
  }
  const int64_t size = int64_t(BlockBytes(block->cls));
  const int64_t used = used_.fetch_add(size, std::memory_order_relaxed) + size;
  for (int64_t peak = peak_.load(std::memory_order_relaxed);
       used > peak && !peak_.compare_exchange_weak(peak, used, std::memory_order_relaxed);) {
  }
  return reinterpret_cast<char*>(block) + kHeader;
}

ReceiveArena::BlockHeader* ReceiveArena::HeaderOf(const void* pointer) const {
  const auto p = reinterpret_cast<uintptr_t>(pointer);
  if (p < begin_ + kHeader || p >= end_ || (p - begin_) % kHeader != 0) return nullptr;
  return reinterpret_cast<BlockHeader*>(p - kHeader);
}

bool ReceiveArena::TryFree(void* pointer) {
  BlockHeader* block = HeaderOf(pointer);
  if (block == nullptr) return false;
  int cls = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (block->state != kLive || block->cls < 0 || block->cls >= kClasses) return false;
    cls = block->cls;
    block->state = kFree;
    block->next = free_[cls];
    free_[cls] = block;
  }
  used_.fetch_sub(int64_t(BlockBytes(cls)), std::memory_order_relaxed);
  return true;
}

void ReceiveArena::Free(void* pointer) {
  if (TryFree(pointer)) return;
  // No logging library here: this runs inside free().
  static constexpr char kMessage[] =
      "flashserve: receive arena: free of a block that is not live (double free or invalid "
      "pointer)\n";
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, kMessage, sizeof(kMessage) - 1);
  __builtin_trap();
}

size_t ReceiveArena::UsableSize(const void* pointer) const {
  const BlockHeader* block = HeaderOf(pointer);
  return block != nullptr && block->state == kLive ? BlockBytes(block->cls) - kHeader : 0;
}

// fork() copies the lock as it is: a child forked while another thread held it would deadlock on
// its first arena malloc. The handlers hold it across fork (no thread is inside the arena then).
void ReceiveArena::LockForFork() {
  if (ReceiveArena* arena = Installed()) arena->mu_.lock();
}

void ReceiveArena::UnlockAfterFork() {
  if (ReceiveArena* arena = Installed()) arena->mu_.unlock();
}

bool ReceiveArena::Install(ReceiveArena* arena) {
  if (const char* refusal = InstallRefusal()) {
    spdlog::warn("receive arena left off: {}", refusal);
    return false;
  }
  ReceiveArena* none = nullptr;
  if (!installed_.compare_exchange_strong(none, arena, std::memory_order_acq_rel)) return false;
  // Registered after the store, so the handlers always find the arena; a fork racing with this
  // one startup call is not a case the server has.
  pthread_atfork(&ReceiveArena::LockForFork, &ReceiveArena::UnlockAfterFork,
                 &ReceiveArena::UnlockAfterFork);
  return true;
}

absl::Status ReceiveArena::InstallOnHeap(size_t bytes) {
  if (Installed() != nullptr) return absl::OkStatus();
  if (const char* refusal = InstallRefusal()) {
    spdlog::warn("--receive_arena_bytes: receive arena left off: {}", refusal);
    return absl::OkStatus();
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", bytes, " bytes"));
  }
  auto* arena = new ReceiveArena(base, bytes, /*page_locked=*/false);
  if (!Install(arena)) {
    delete arena;
    munmap(base, bytes);
  }
  return absl::OkStatus();
}

}  // namespace flashserve
