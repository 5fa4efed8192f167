// Keeps a client's shared-memory object from crashing the server. An access to a page of a
// MAP_SHARED mapping past its object's end (the client ftruncate'd the object after registering
// it) or on a hole tmpfs cannot back (/dev/shm is full) raises SIGBUS, whose default action kills
// the process: every other client's requests with it. Registered mappings are watched instead:
// a SIGBUS inside one replaces the mapping from the faulting page to its end with anonymous zero
// pages (so the access completes) and marks the mapping faulted. What the server read there was
// not the client's, and what it wrote there never reaches the client, so the registry refuses a
// faulted region and the edges fail every request that held it (ShmRegistry::CheckLease).
//
// A SIGBUS anywhere else goes to the handler installed before this one (or the default action).
#pragma once

#include <cstddef>

namespace flashserve {

class ShmFaultGuard {
 public:
  /// At most this many mappings are watched at once (a registration past it is refused).
  static constexpr int kMaxWatched = 1 << 16;

  /// Watches [mapping, mapping + bytes) (page-aligned start) until Unwatch; installs the handler
  /// on first use. -1 when kMaxWatched mappings are watched already.
  static int Watch(void* mapping, size_t bytes);
  /// Stops watching; call before unmapping, once no request uses the mapping.
  static void Unwatch(int slot);
  /// A SIGBUS hit the mapping since Watch.
  static bool Faulted(int slot);
};

}  // namespace flashserve
