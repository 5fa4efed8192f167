// The gRPC resource quota: how much memory gRPC's transport may hold for buffers (received
// messages included) before it pushes back.
//
// GrpcOptions::memory_quota_bytes:
//   > 0  that many bytes;
//   0    no quota of ours (gRPC's default: unbounded);
//   -1   auto (the default): a quarter of the host's memory, at most 4 GiB, and never less than
//        max_request_bytes + 64 MiB.
// Why these numbers: the quota bounds only what gRPC buffers; the tensors an accepted request
// becomes are bounded separately (--max_inflight_bytes, the receive arena, the pinned pool) and
// need most of the memory, so gRPC gets a quarter. 4 GiB holds four requests of the default
// maximal size (1 GiB) at once, as much as --max_inflight_bytes (default 4 GiB) lets the runtime
// accept: buffering more in gRPC would only delay the push-back. The floor lets one request of
// the largest accepted size arrive whole while other streams have their flow-control lookahead
// (64 MiB, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES) in flight; below it the largest request could
// never be received.
// What gRPC 1.51 does at the quota (measured here, CPU backend: four concurrent 200 MiB Attention
// calls that stayed in the runtime, quota 300 MiB): it resets streams (RST_STREAM
// ENHANCE_YOUR_CALM; the clients got RESOURCE_EXHAUSTED). The bound is soft: the process still
// peaked at 578 MiB RSS (1.9x the quota) in that run.
// "The host's memory" is the smaller of physical memory and the cgroup's memory limit, so a pod
// is sized from its own limit, not from the node's RAM.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace flashserve {

inline constexpr int64_t kGrpcMemoryQuotaAuto = -1;
inline constexpr int64_t kGrpcMemoryQuotaMaxAuto = int64_t{4} << 30;
inline constexpr int64_t kGrpcMemoryQuotaHeadroom = int64_t{64} << 20;

/// Physical memory, or the cgroup (v2 or v1) memory limit when that is smaller; 0 if unknown
/// (ReadHostMemoryBound: the process's own cgroup and its ancestors, not only the root's file).
int64_t HostMemoryBytes();

/// The quota in bytes for `requested` (see above; 0: none), or INVALID_ARGUMENT for values below
/// -1. `host_memory_bytes` (0: unknown, then auto gives 4 GiB or the floor) is HostMemoryBytes()
/// outside tests.
absl::StatusOr<int64_t> ResolveGrpcMemoryQuota(int64_t requested, int64_t max_request_bytes,
                                               int64_t host_memory_bytes);

}  // namespace flashserve
