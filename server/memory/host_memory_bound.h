// The most memory this process can have: physical memory, or the memory limit of its cgroup
// (v2: memory.max of its cgroup and every ancestor; v1: the memory controller's root limit) when
// that is smaller. A pool that is mapped lazily (MAP_NORESERVE: the CPU backend's KV cache) is
// checked against it at startup: mmap accepts a pool larger than the host, and the kernel's OOM
// killer ends the process once the pool fills, long after startup said yes.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace flashserve {

/// A bound of 0 bytes is unknown: nothing is refused against it.
struct HostMemoryBound {
  int64_t bytes = 0;
  std::string source;  // "physical memory" or "the cgroup memory limit in <file>"
};

/// Where the bound is read from. The defaults are this process's; tests point them elsewhere.
struct HostMemorySources {
  static constexpr int64_t kAskTheSystem = -1;
  int64_t physical_bytes = kAskTheSystem;  // kAskTheSystem: sysconf(_SC_PHYS_PAGES) * page size
  std::string cgroup_root = "/sys/fs/cgroup";
  std::string proc_self_cgroup = "/proc/self/cgroup";  // its "0::<path>" line: the v2 cgroup
};

/// The smallest of physical memory and the cgroup limits found. Files that are missing, "max" or
/// unparsable set no limit. Thread-safe.
HostMemoryBound ReadHostMemoryBound(const HostMemorySources& sources = {});

/// INVALID_ARGUMENT "--<flag>=<bytes> ... more than <source>: <bound> bytes" when `bytes` passes
/// a known bound; OK otherwise.
absl::Status CheckFitsHostMemory(absl::string_view flag, int64_t bytes,
                                 const HostMemoryBound& bound);

}  // namespace flashserve
