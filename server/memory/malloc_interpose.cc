// Replaces malloc's entry points in the flashserve executable (glibc supports this: "Replacing
// malloc" in its manual) so that, once a ReceiveArena is installed, allocations of a socket read
// buffer's size come from it. Everything else, and everything before the arena exists, goes to
// glibc's own allocator (__libc_*), so the behaviour of the rest of the process is unchanged.
// memalign/posix_memalign/aligned_alloc/valloc are left to glibc: their blocks are never in the
// arena, and free() below hands them back to glibc.
//
// Linked only into the server binary (not into tests or sanitizer builds, which bring their own
// malloc). See receive_arena.h for why.
#include <dlfcn.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include "memory/receive_arena.h"

extern "C" {
void* __libc_malloc(size_t size);
void __libc_free(void* pointer);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* pointer, size_t size);
}

namespace {

using flashserve::ReceiveArena;
using UsableSizeFn = size_t (*)(void*);

// glibc's malloc_usable_size, for blocks that are not the arena's (looked up before main, when no
// arena exists yet, so dlsym's own allocations go straight to glibc).
UsableSizeFn g_libc_usable_size = nullptr;
__attribute__((constructor)) void ResolveLibcUsableSize() {
  g_libc_usable_size = reinterpret_cast<UsableSizeFn>(dlsym(RTLD_NEXT, "malloc_usable_size"));
}

inline ReceiveArena* ArenaOwning(const void* pointer) {
  ReceiveArena* arena = ReceiveArena::Installed();
  return arena != nullptr && pointer != nullptr && arena->Owns(pointer) ? arena : nullptr;
}

}  // namespace

extern "C" {

void* malloc(size_t size) noexcept {
  if (size >= ReceiveArena::kMinRequest && size <= ReceiveArena::kMaxRequest) {
    if (ReceiveArena* arena = ReceiveArena::Installed()) {
      if (void* block = arena->Allocate(size)) return block;
    }
  }
  return __libc_malloc(size);
}

void free(void* pointer) noexcept {
  if (ReceiveArena* arena = ArenaOwning(pointer)) {
    arena->Free(pointer);
    return;
  }
  __libc_free(pointer);
}

void* calloc(size_t count, size_t size) noexcept { return __libc_calloc(count, size); }

void* realloc(void* pointer, size_t size) noexcept {
  ReceiveArena* arena = ArenaOwning(pointer);
  if (arena == nullptr) return __libc_realloc(pointer, size);
  if (size == 0) {  // as glibc: frees and returns null
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

void* reallocarray(void* pointer, size_t count, size_t size) noexcept {
  size_t bytes = 0;
  if (__builtin_mul_overflow(count, size, &bytes)) {
    errno = ENOMEM;
    return nullptr;
  }
  return realloc(pointer, bytes);
}

size_t malloc_usable_size(void* pointer) noexcept {
  if (ReceiveArena* arena = ArenaOwning(pointer)) return arena->UsableSize(pointer);
  return g_libc_usable_size != nullptr && pointer != nullptr ? g_libc_usable_size(pointer) : 0;
}

}  // extern "C"
