// Replaces malloc's entry points in the flashserve executable (glibc supports this: "Replacing
// malloc" in its manual) so that, once a ReceiveArena is installed, allocations of a socket read
// buffer's size come from it.
//
// Every entry point or none: a block from any of them may reach any other (free, realloc,
// malloc_usable_size), so all of them are defined here: malloc, free, calloc, realloc,
// reallocarray, memalign, posix_memalign, aligned_alloc, valloc, pvalloc, malloc_usable_size and
// cfree. A block the arena does not own goes to the allocator that would have served the process
// without this file: the next definition after the executable (dlsym(RTLD_NEXT)), which is glibc's
// malloc, or jemalloc's/tcmalloc's when one is preloaded or linked. Only malloc consults the arena.
//
// A foreign allocator (the next malloc is not in the object that holds glibc): this file only
// forwards, and the arena is refused (ReceiveArena::RefuseInstall), so the server runs on that
// allocator alone, with a warning if an arena was asked for. The arena's blocks are meant for
// glibc's world (gRPC's read buffers), and mixing two allocators' blocks is what crashed before.
//
// The real functions are looked up on the first call (usually from the dynamic loader, before
// main). dlsym may allocate: calls made while the lookup runs are served from a small static
// bootstrap region whose blocks are never given back.
//
// Linked only into the server binary and malloc_interpose_test (not into other tests or
// sanitizer builds, which bring their own malloc: server/CMakeLists.txt refuses that combination).
#include <dlfcn.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "memory/receive_arena.h"

namespace {

using flashserve::ReceiveArena;

// The allocator the process would have without this file. Written once, before g_state says
// kResolved; read-only afterwards.
struct RealAllocator {
  void* (*malloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
  void* (*calloc)(size_t, size_t) = nullptr;
  void* (*realloc)(void*, size_t) = nullptr;
  // Optional: used when the allocator has them, else derived from the ones it has.
  void* (*memalign)(size_t, size_t) = nullptr;
  int (*posix_memalign)(void**, size_t, size_t) = nullptr;
  void* (*aligned_alloc)(size_t, size_t) = nullptr;
  size_t (*usable_size)(void*) = nullptr;
};

enum State : int { kUnresolved, kResolving, kResolved };
std::atomic<int> g_state{kUnresolved};
RealAllocator g_real;

// The bootstrap region: bump-allocated, 16-byte header holding the size, never reused.
constexpr size_t kBootstrapBytes = size_t{256} << 10;
alignas(4096) char g_bootstrap[kBootstrapBytes];
std::atomic<size_t> g_bootstrap_used{0};

bool IsBootstrap(const void* pointer) {
  const auto p = reinterpret_cast<uintptr_t>(pointer);
  const auto base = reinterpret_cast<uintptr_t>(g_bootstrap);
  return p >= base && p < base + kBootstrapBytes;
}

void* BootstrapAllocate(size_t bytes, size_t alignment) {
  alignment = std::max<size_t>(alignment, 16);
  if (alignment > 4096 || (alignment & (alignment - 1)) != 0 || bytes > kBootstrapBytes) return nullptr;
  size_t used = g_bootstrap_used.load(std::memory_order_relaxed);
  size_t start = 0;
  do {
    start = (used + 16 + alignment - 1) / alignment * alignment;
    if (start + bytes > kBootstrapBytes) {
      errno = ENOMEM;
      return nullptr;
    }
  } while (!g_bootstrap_used.compare_exchange_weak(used, start + bytes, std::memory_order_relaxed));
  std::memcpy(g_bootstrap + start - sizeof(size_t), &bytes, sizeof(size_t));
  return g_bootstrap + start;  // zero: static storage, never handed out twice
}

size_t BootstrapSize(const void* pointer) {
  size_t bytes = 0;
  std::memcpy(&bytes, static_cast<const char*>(pointer) - sizeof(size_t), sizeof(size_t));
  return bytes;
}

// The object (shared library) `symbol` lives in, or nullptr.
const void* ObjectOf(void* symbol) {
  Dl_info info{};
  return symbol != nullptr && dladdr(symbol, &info) != 0 ? info.dli_fbase : nullptr;
}

// RTLD_NEXT's `name` if the allocator's object defines it (a foreign allocator that lacks, say,
// memalign must not be paired with glibc's, which would hand out glibc blocks).
template <typename Fn>
void Lookup(const char* name, const void* allocator_object, Fn* out) {
  void* symbol = dlsym(RTLD_NEXT, name);
  *out = ObjectOf(symbol) == allocator_object ? reinterpret_cast<Fn>(symbol) : nullptr;
}

void Die(const char* message) {
  [[maybe_unused]] const ssize_t written = write(STDERR_FILENO, message, strlen(message));
  abort();
}

void Resolve() {
  int expected = kUnresolved;
  if (!g_state.compare_exchange_strong(expected, kResolving, std::memory_order_acq_rel)) return;
  RealAllocator real;
  real.malloc = reinterpret_cast<void* (*)(size_t)>(dlsym(RTLD_NEXT, "malloc"));
  const void* allocator = ObjectOf(reinterpret_cast<void*>(real.malloc));
  if (allocator == nullptr) Die("flashserve: malloc_interpose: no malloc after the executable\n");
  Lookup("free", allocator, &real.free);
  Lookup("calloc", allocator, &real.calloc);
  Lookup("realloc", allocator, &real.realloc);
  Lookup("memalign", allocator, &real.memalign);
  Lookup("posix_memalign", allocator, &real.posix_memalign);
  Lookup("aligned_alloc", allocator, &real.aligned_alloc);
  Lookup("malloc_usable_size", allocator, &real.usable_size);
  if (real.free == nullptr || real.calloc == nullptr || real.realloc == nullptr ||
      (real.memalign == nullptr && real.posix_memalign == nullptr && real.aligned_alloc == nullptr)) {
    Die("flashserve: malloc_interpose: the process's allocator lacks free/calloc/realloc/memalign\n");
  }
  const void* libc = ObjectOf(dlsym(RTLD_NEXT, "gnu_get_libc_version"));
  if (allocator != libc) {
    ReceiveArena::RefuseInstall(
        "the process runs on another allocator than glibc's (LD_PRELOAD of jemalloc, tcmalloc, "
        "...); the arena's malloc replacement only forwards to it");
  }
  g_real = real;
  g_state.store(kResolved, std::memory_order_release);
}

// The real allocator, or nullptr while the lookup runs (then the bootstrap region serves).
inline const RealAllocator* Real() {
  if (g_state.load(std::memory_order_acquire) == kResolved) [[likely]] return &g_real;
  Resolve();
  return g_state.load(std::memory_order_acquire) == kResolved ? &g_real : nullptr;
}

inline ReceiveArena* ArenaOwning(const void* pointer) {
  ReceiveArena* arena = ReceiveArena::Installed();
  return arena != nullptr && pointer != nullptr && arena->Owns(pointer) ? arena : nullptr;
}

// memalign's contract as glibc has it (an alignment that is no power of two is rounded up to one,
// and to a pointer's size), on what the allocator has.
void* AlignedAllocate(size_t alignment, size_t bytes) {
  if (alignment > SIZE_MAX / 2 + 1) {
    errno = EINVAL;
    return nullptr;
  }
  size_t rounded = sizeof(void*);
  while (rounded < alignment) rounded <<= 1;
  alignment = rounded;
  const RealAllocator* real = Real();
  if (real == nullptr) return BootstrapAllocate(bytes, alignment);
  if (real->memalign != nullptr) return real->memalign(alignment, bytes);
  if (real->posix_memalign != nullptr) {
    void* out = nullptr;
    const int error = real->posix_memalign(&out, alignment, bytes);
    if (error != 0) errno = error;
    return error == 0 ? out : nullptr;
  }
  // aligned_alloc may insist on a size that is a multiple of the alignment; rounding a size near
  // SIZE_MAX up would wrap to a tiny block.
  if (bytes > SIZE_MAX - (alignment - 1)) {
    errno = ENOMEM;
    return nullptr;
  }
  return real->aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment);
}

void* ReallocateArenaBlock(ReceiveArena* arena, void* pointer, size_t size);

}  // namespace

extern "C" {

void* malloc(size_t size) noexcept {
  if (size >= ReceiveArena::kMinRequest && size <= ReceiveArena::kMaxRequest) {
    if (ReceiveArena* arena = ReceiveArena::Installed()) {
      if (void* block = arena->Allocate(size)) return block;
    }
  }
  const RealAllocator* real = Real();
  return real != nullptr ? real->malloc(size) : BootstrapAllocate(size, 16);
}

void free(void* pointer) noexcept {
  if (pointer == nullptr || IsBootstrap(pointer)) return;
  if (ReceiveArena* arena = ArenaOwning(pointer)) {
    arena->Free(pointer);
    return;
  }
  if (const RealAllocator* real = Real()) real->free(pointer);
}

void cfree(void* pointer) noexcept { free(pointer); }  // glibc keeps it for old binaries

void* calloc(size_t count, size_t size) noexcept {
  const RealAllocator* real = Real();
  if (real != nullptr) return real->calloc(count, size);
  size_t bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes)) {
    errno = ENOMEM;
    return nullptr;
  }
  return BootstrapAllocate(bytes, 16);  // zero already
}

void* realloc(void* pointer, size_t size) noexcept {
  if (pointer == nullptr) return malloc(size);
  if (ReceiveArena* arena = ArenaOwning(pointer)) return ReallocateArenaBlock(arena, pointer, size);
  if (IsBootstrap(pointer)) {
    void* moved = malloc(size);
    if (moved != nullptr) std::memcpy(moved, pointer, std::min(size, BootstrapSize(pointer)));
    return moved;
  }
  const RealAllocator* real = Real();
  return real != nullptr ? real->realloc(pointer, size) : nullptr;
}

void* reallocarray(void* pointer, size_t count, size_t size) noexcept {
  size_t bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes)) {
    errno = ENOMEM;
    return nullptr;
  }
  return realloc(pointer, bytes);
}

void* memalign(size_t alignment, size_t size) noexcept { return AlignedAllocate(alignment, size); }

int posix_memalign(void** out, size_t alignment, size_t size) noexcept {
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0 || alignment == 0) {
    return EINVAL;
  }
  const int saved_errno = errno;
  void* block = AlignedAllocate(alignment, size);
  errno = saved_errno;  // posix_memalign reports through its result, errno untouched
  if (block == nullptr) return ENOMEM;
  *out = block;
  return 0;
}

void* aligned_alloc(size_t alignment, size_t size) noexcept {
  const RealAllocator* real = Real();
  if (real != nullptr && real->aligned_alloc != nullptr) return real->aligned_alloc(alignment, size);
  return AlignedAllocate(alignment, size);
}

void* valloc(size_t size) noexcept { return AlignedAllocate(size_t(sysconf(_SC_PAGESIZE)), size); }

void* pvalloc(size_t size) noexcept {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  if (size > SIZE_MAX - page) {
    errno = ENOMEM;
    return nullptr;
  }
  return AlignedAllocate(page, std::max<size_t>((size + page - 1) / page * page, page));
}

size_t malloc_usable_size(void* pointer) noexcept {
  if (pointer == nullptr) return 0;
  if (ReceiveArena* arena = ArenaOwning(pointer)) return arena->UsableSize(pointer);
  if (IsBootstrap(pointer)) return BootstrapSize(pointer);
  const RealAllocator* real = Real();
  return real != nullptr && real->usable_size != nullptr ? real->usable_size(pointer) : 0;
}

}  // extern "C"

namespace {

// realloc of an arena block: kept when it is big enough, else moved to a new block (arena or
// heap, as malloc decides); size 0 frees it and returns null, as glibc does.
void* ReallocateArenaBlock(ReceiveArena* arena, void* pointer, size_t size) {
  if (size == 0) {
    arena->Free(pointer);
    return nullptr;
  }
  const size_t usable = arena->UsableSize(pointer);
  if (size <= usable) return pointer;
  void* grown = malloc(size);
  if (grown == nullptr) return nullptr;  // errno set by malloc; the old block stays valid
  std::memcpy(grown, pointer, usable);
  arena->Free(pointer);
  return grown;
}

// Resolve before main even when nothing allocates earlier, so that a foreign allocator refuses
// the arena before the server could install one.
__attribute__((constructor)) void ResolveAtStartup() { Real(); }

}  // namespace
