#include "edge/grpc/grpc_memory_quota.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "memory/host_memory_bound.h"

namespace flashserve {

int64_t HostMemoryBytes() { return ReadHostMemoryBound().bytes; }

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
