#include "edge/grpc/grpc_memory_quota.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace flashserve {
namespace {

// A cgroup memory limit file's value; 0 when absent, "max" or unparsable.
int64_t ReadLimit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!in || !std::getline(in, text)) return 0;
  int64_t value = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &value) || value <= 0) return 0;
  return value;
}

}  // namespace

int64_t HostMemoryBytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  int64_t bytes = pages > 0 && page_size > 0 ? int64_t{pages} * page_size : 0;
  // cgroup v2, then v1 (whose "no limit" is a huge number, which the min ignores).
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    const int64_t limit = ReadLimit(path);
    if (limit > 0) bytes = bytes > 0 ? std::min(bytes, limit) : limit;
  }
  return bytes;
}

absl::StatusOr<int64_t> ResolveGrpcMemoryQuota(int64_t requested, int64_t max_request_bytes,
                                               int64_t host_memory_bytes) {
  if (requested >= 0) return requested;
  if (requested != kGrpcMemoryQuotaAuto) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--grpc_memory_quota_bytes must be -1 (auto), 0 (none) or > 0, got ", requested));
  }
  const int64_t share = host_memory_bytes > 0
                            ? std::min(host_memory_bytes / 4, kGrpcMemoryQuotaMaxAuto)
                            : kGrpcMemoryQuotaMaxAuto;
  return std::max(share, max_request_bytes + kGrpcMemoryQuotaHeadroom);
}

}  // namespace flashserve
