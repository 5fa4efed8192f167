#include "memory/host_memory_bound.h"

#include <unistd.h>

#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace flashserve {
namespace {

// The first line of a cgroup limit file as a byte count; 0 when absent, "max" or unparsable.
int64_t ReadLimitFile(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!in || !std::getline(in, text)) return 0;
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) || value <= 0) return 0;
  return value;
}

int64_t PhysicalMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_size > 0 ? int64_t{pages} * page_size : 0;
}

// This process's cgroup v2 path below the root, without a trailing '/' ("" for the root), from
// its "0::<path>" line. A cgroup outside our namespace reads "/../.."; only the root is ours then.
std::string CgroupV2Path(const std::string& proc_self_cgroup) {
  std::ifstream in(proc_self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view path = line;
    if (!absl::ConsumePrefix(&path, "0::")) continue;
    if (absl::StrContains(path, "/..")) return "";
    while (absl::ConsumeSuffix(&path, "/")) {
    }
    return std::string(path);
  }
  return "";
}

// Lowers `bound` to the limit in `file` when that is smaller.
void TakeLimit(const std::string& file, HostMemoryBound* bound) {
  const int64_t limit = ReadLimitFile(file);
  if (limit > 0 && (bound->bytes == 0 || limit < bound->bytes)) {
    bound->bytes = limit;
    bound->source = absl::StrCat("the cgroup memory limit in ", file);
  }
}

// 1.5 GiB, 16.0 EiB: for the operator reading the message; the exact count stands beside it.
std::string InBinaryUnits(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = double(bytes) / 1024;
  int unit = 0;
  while (value >= 1024 && unit + 1 < int(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

}  // namespace

HostMemoryBound ReadHostMemoryBound(const HostMemorySources& sources) {
  HostMemoryBound bound;
  const int64_t physical = sources.physical_bytes == HostMemorySources::kAskTheSystem
                               ? PhysicalMemoryBytes()
                               : sources.physical_bytes;
  if (physical > 0) bound = {physical, "physical memory"};
  // cgroup v2 enforces every ancestor's memory.max too. In a container with its own cgroup
  // namespace the path is "" and the container's limit is the root's file; without one the path
  // names directories the container does not see, and the walk reaches the root's file all the
  // same. (The host's root cgroup has no memory.max.)
  std::string path = CgroupV2Path(sources.proc_self_cgroup);
  while (true) {
    TakeLimit(absl::StrCat(sources.cgroup_root, path, "/memory.max"), &bound);
    if (path.empty()) break;
    const size_t parent_end = path.rfind('/');
    path.resize(parent_end == std::string::npos ? 0 : parent_end);
  }
  // cgroup v1, the memory controller's root only; its "no limit" is near 2^63 and never smaller.
  TakeLimit(absl::StrCat(sources.cgroup_root, "/memory/memory.limit_in_bytes"), &bound);
  return bound;
}

absl::Status CheckFitsHostMemory(absl::string_view flag, int64_t bytes,
                                 const HostMemoryBound& bound) {
  if (bound.bytes <= 0 || bytes <= bound.bytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, "=", bytes, " (", InBinaryUnits(bytes), ") is more memory than this host has: ",
      bound.source, " is ", bound.bytes, " bytes (", InBinaryUnits(bound.bytes), ")"));
}

}  // namespace flashserve
