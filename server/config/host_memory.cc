#include "config/host_memory.h"

#include <malloc.h>

#include <cstddef>

#include "absl/strings/str_cat.h"
#include "memory/receive_arena.h"
#include "spdlog/spdlog.h"
#ifdef FLASHSERVE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashserve {
namespace {

// Page-locked memory from CUDA (portable: every device's copies may use it), or nullptr.
void* PageLockedBytes(size_t bytes) {
#ifdef FLASHSERVE_WITH_CUDA
  void* base = nullptr;
  if (cudaError_t e = cudaHostAlloc(&base, bytes, cudaHostAllocPortable); e != cudaSuccess) {
    cudaGetLastError();
    spdlog::warn(
        "--receive_arena_bytes: cannot page-lock {} bytes ({}); request tensors are copied into "
        "pinned staging memory instead",
        bytes, cudaGetErrorString(e));
    return nullptr;
  }
  return base;
#else
  spdlog::warn("--receive_arena_bytes: this binary has no CUDA to page-lock memory with");
  return nullptr;
#endif
}

void FreePageLocked(void* base) {
#ifdef FLASHSERVE_WITH_CUDA
  cudaFreeHost(base);
#endif
}

}  // namespace

void ApplyMallocOptions(const MallocOptions& options) {
  if (const char* other = ReceiveArena::InstallRefusal()) {
    // jemalloc or tcmalloc preloaded: glibc's mallopt still answers (and succeeds), for an
    // allocator nobody uses, so the flags would seem to work.
    const MallocOptions defaults;
    if (options.mmap_threshold_bytes != defaults.mmap_threshold_bytes ||
        options.trim_threshold_bytes != defaults.trim_threshold_bytes ||
        options.arena_max != defaults.arena_max) {
      spdlog::warn(
          "--malloc_mmap_threshold_bytes, --malloc_trim_threshold_bytes and "
          "--malloc_arena_max tune glibc's malloc, which this process does not use ({}): "
          "they have no effect",
          other);
    }
    return;
  }
  if (options.mmap_threshold_bytes != 0 &&
      mallopt(M_MMAP_THRESHOLD, int(options.mmap_threshold_bytes)) != 1) {
    spdlog::warn(
        "--malloc_mmap_threshold_bytes: the allocator refused mallopt(M_MMAP_THRESHOLD); "
        "not glibc's malloc?");
  }
  if (options.arena_max != 0 && mallopt(M_ARENA_MAX, options.arena_max) != 1) {
    spdlog::warn(
        "--malloc_arena_max: the allocator refused mallopt(M_ARENA_MAX); not glibc's "
        "malloc?");
  }
}

absl::Status InstallReceiveArena(const MemoryOptions& options, const std::string& backend_name) {
  const int64_t bytes = options.ReceiveArenaBytesFor(backend_name);
  // One per process: its blocks may be freed until exit, so it is never replaced or released.
  if (bytes <= 0 || ReceiveArena::Installed() != nullptr) return absl::OkStatus();
  if (backend_name != "cuda") {
    if (absl::Status s = ReceiveArena::InstallOnHeap(size_t(bytes)); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--receive_arena_bytes: ", s.message()));
    }
    return absl::OkStatus();
  }
  if (const char* refusal = ReceiveArena::InstallRefusal()) {  // e.g. jemalloc preloaded
    spdlog::warn("--receive_arena_bytes: receive arena left off: {}", refusal);
    return absl::OkStatus();
  }
  void* base = PageLockedBytes(size_t(bytes));
  if (base == nullptr) return absl::OkStatus();
  auto* arena = new ReceiveArena(base, size_t(bytes), /*page_locked=*/true);
  if (!ReceiveArena::Install(arena)) {  // refused (it said why)
    delete arena;
    FreePageLocked(base);
    return absl::OkStatus();
  }
  spdlog::info("receive arena: {} MiB of page-locked memory for gRPC's read buffers", bytes >> 20);
  return absl::OkStatus();
}

}  // namespace flashserve
