// A region of (page-locked) memory that serves the process's buffer-sized malloc calls, so gRPC's
// socket reads land where the GPU can copy from directly.
//
// Why: gRPC 1.51 reads every message into buffers it mallocs (64 KiB each, plus a slice header,
// once a connection carries big messages) and offers no hook to allocate them elsewhere. A
// request's tensors then had to be copied once into pinned memory before the H2D copy, and that
// copy is what kept the service short of the raw gRPC echo: measured on an H100 host, skipping it
// took medium requests at 16 concurrent clients from 0.66x to 0.82-0.89x of the echo, and the
// small request's copy costs 31-46 us (bench/results/service-h100-2026-11-22-arena.md). With
// malloc_interpose.cc linked into the server, mallocs of a read buffer's size come from this arena;
// when all of a request's tensor bytes lie in it the backend copies them to the device in place.
//
// Blocks come in seven classes (64 KiB .. 4 MiB, each with a page of room for gRPC's slice
// header), carved from the region on first use and kept on per-class free lists afterwards
// (never merged; a request for an empty class takes a free block of a larger class, which goes back
// to its own class when freed). When nothing fits, Allocate returns nullptr and the caller falls
// back to the ordinary heap: the arena is an accelerator, never a limit.
//
// Thread-safe; never calls malloc (it runs inside it), except Install/InstallOnHeap (startup).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "absl/status/status.h"

namespace flashserve {

class ReceiveArena {
 public:
  static constexpr int kClasses = 7;
  static constexpr size_t kMinBlock = size_t{64} << 10;
  static constexpr size_t kSlack = 4096;   // room for an allocator header beyond a power of two
  static constexpr size_t kHeader = 64;    // before every block: its class (keeps 64-byte alignment)
  /// The largest request the arena serves, and the smallest it bothers with.
  static constexpr size_t kMaxRequest = (kMinBlock << (kClasses - 1)) + kSlack - kHeader;
  static constexpr size_t kMinRequest = kMinBlock / 2 + 1;

  /// Serves blocks from [base, base + bytes). `page_locked`: the region is registered with CUDA.
  ReceiveArena(void* base, size_t bytes, bool page_locked);
  ReceiveArena(const ReceiveArena&) = delete;
  ReceiveArena& operator=(const ReceiveArena&) = delete;

  /// nullptr when `bytes` is outside [kMinRequest, kMaxRequest] or no block is left.
  void* Allocate(size_t bytes);
  /// Returns a block from Allocate to its class. Anything else (a second free of the same block,
  /// a pointer Allocate did not return) is reported on stderr and traps: the check and the state
  /// change happen under the lock, so of two racing frees of one block exactly one succeeds.
  void Free(void* pointer);
  /// Free without the trap: false (and nothing changed) when `pointer` is not a live block.
  bool TryFree(void* pointer);
  /// Bytes usable at `pointer` (a live block from Allocate): its block's size less the header.
  size_t UsableSize(const void* pointer) const;

  bool Owns(const void* pointer) const {
    const auto p = reinterpret_cast<uintptr_t>(pointer);
    return p >= begin_ && p < end_;
  }
  /// [data, data + bytes) lies inside the region.
  bool Contains(const void* data, size_t bytes) const {
    const auto p = reinterpret_cast<uintptr_t>(data);
    return p >= begin_ && p <= end_ && bytes <= end_ - p;
  }
  bool page_locked() const { return page_locked_; }
  size_t capacity() const { return end_ - begin_; }
  /// Bytes in blocks handed out now (headers included).
  int64_t used_bytes() const { return used_.load(std::memory_order_relaxed); }
  /// The most used_bytes() has been (what sizing the arena needs).
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  /// Allocations it could not serve for want of a block (the heap served them).
  int64_t misses() const { return misses_.load(std::memory_order_relaxed); }

  /// The arena the server's malloc consults; null until one is installed (once, at startup; never
  /// uninstalled, since blocks may be freed at any time until exit).
  static ReceiveArena* Installed() { return installed_.load(std::memory_order_acquire); }
  /// Whether [data, data + bytes) lies in the installed arena and that arena is page-locked: true
  /// for gRPC's read buffers and for any other buffer-sized malloc it served (e.g. a parsed
  /// message's large bytes fields), which a GPU can then read where they are.
  static bool PageLockedHolds(const void* data, size_t bytes) {
    const ReceiveArena* arena = Installed();
    return arena != nullptr && arena->page_locked() && arena->Contains(data, bytes);
  }
  /// Makes `arena` the process's arena and registers fork handlers that hold its lock across
  /// fork() (so a child never inherits it locked). Returns false, and installs nothing, when an
  /// arena is installed already or installing is refused (then logs a warning); the caller keeps
  /// `arena` and its memory.
  static bool Install(ReceiveArena* arena);
  /// Installs an arena of ordinary (not page-locked) memory: the CPU backend gains nothing from
  /// it, but the whole server then runs on arena-allocated read buffers, which the tests use.
  /// When installing is refused, logs a warning, maps nothing and returns OK (the server runs
  /// without the arena).
  static absl::Status InstallOnHeap(size_t bytes);

  /// Called by the malloc replacement (malloc_interpose.cc) when the process's allocator is not
  /// glibc's (e.g. jemalloc or tcmalloc preloaded): from then on Install refuses. `reason` must
  /// be a string that lives forever. Safe inside malloc (one atomic store).
  static void RefuseInstall(const char* reason) { refusal_.store(reason, std::memory_order_release); }
  /// Why installing is refused, or nullptr when it is allowed. Callers that must prepare memory
  /// for an arena (page-locking a region) check this first.
  static const char* InstallRefusal() { return refusal_.load(std::memory_order_acquire); }

 private:
  struct BlockHeader;  // at the start of every block, kHeader bytes (receive_arena.cc)
  static size_t BlockBytes(int cls) { return (kMinBlock << cls) + kSlack; }
  BlockHeader* HeaderOf(const void* pointer) const;
  static void LockForFork();
  static void UnlockAfterFork();

  const uintptr_t begin_, end_;
  const bool page_locked_;
  std::mutex mu_;
  uintptr_t bump_;                        // guarded by mu_: start of the never-used tail
  BlockHeader* free_[kClasses] = {};      // guarded by mu_, as is every block header
  std::atomic<int64_t> used_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> misses_{0};
  static std::atomic<ReceiveArena*> installed_;
  static std::atomic<const char*> refusal_;
};

}  // namespace flashserve
