// The process's host-memory settings, applied from here and nowhere else: glibc malloc's
// thresholds and arena count, and the receive arena (memory/receive_arena.h) that the server's
// malloc replacement serves gRPC's read buffers from.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "config/server_config.h"

namespace flashserve {

/// mallopt() for each non-zero option. Call before the first thread starts: glibc gives a thread
/// its arena on its first allocation. Another allocator (a sanitizer's, jemalloc through
/// LD_PRELOAD) refuses mallopt: that is logged as a warning, not an error.
void ApplyMallocOptions(const MallocOptions& options);

/// Installs the receive arena for the backend that serves (`backend_name`, "cuda" or "cpu"):
/// MemoryOptions::ReceiveArenaBytesFor bytes, page-locked on CUDA (if they cannot be page-locked,
/// a warning and no arena: requests are then copied into pinned staging memory), heap memory on
/// the CPU backend. Once per process, after the backend exists and before any listener starts.
absl::Status InstallReceiveArena(const MemoryOptions& options, const std::string& backend_name);

}  // namespace flashserve
