// What a Sequences call holds until it is answered -- its bytes counted against
// --max_inflight_bytes and its leases on shared-memory regions -- and how many bytes that is.
// Shared by the gRPC service (sequences_service.cc) and the local socket (edge/local).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "edge/sequences/sequences_shm.h"
#include "flashserve/v1/sequences.pb.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

/// Not thread-safe: one owner at a time. May outlive the runtime (an answer gRPC still holds).
struct CallHold {
  std::shared_ptr<InflightBytes> budget;  // the runtime's count, shared: not the runtime
  int64_t bytes = 0;                      // reserved (given back when destroyed)
  SequenceShm shm;
  CallHold() = default;
  CallHold(const CallHold&) = delete;
  CallHold& operator=(const CallHold&) = delete;
  ~CallHold() {
    if (budget != nullptr) budget->Release(bytes);
  }
  /// Once per hold.
  absl::Status Reserve(AttentionRuntime* rt, int64_t n) {
    std::shared_ptr<InflightBytes> count = rt->inflight_budget();
    if (absl::Status s = count->Reserve(n); !s.ok()) return s;
    budget = std::move(count);
    bytes = n;
    return absl::OkStatus();
  }
};

/// q's bytes, inline or in a region (a claimed size, checked against the region later; capped so
/// that a lie cannot overflow the sum, only fail the reservation).
inline int64_t QueryBytes(const v1::Tensor& q) {
  if (!q.has_shm()) return int64_t(q.data().size());
  return int64_t(std::min<uint64_t>(q.shm().byte_size(), uint64_t{1} << 40));
}

/// LSE's bytes for q of `q_bytes`: 4 per (row, head), i.e. 4 * q_bytes / (element size *
/// head_dim) from q's dtype and last dimension. A claim the bytes contradict is refused before an
/// answer is made, so the estimate need only hold for consistent ones (2 * q_bytes, the most, was
/// 128x LSE's size at d128 and refused steps whose answers fit a message). Without a usable last
/// dimension: 2 * q_bytes (head_dim 1 of a 2-byte dtype).
inline int64_t LseBytesAtMost(const v1::Tensor& q, int64_t q_bytes) {
  const int64_t head_dim = q.shape_size() > 0 ? q.shape(q.shape_size() - 1) : 0;
  if (head_dim < 1) return 2 * q_bytes;
  const int64_t element = q.dtype() == v1::FLOAT32 ? 4 : 2;
  const int64_t row_bytes = element * std::min(head_dim, int64_t{1} << 40);  // no overflow
  return (4 * q_bytes + row_bytes - 1) / row_bytes;
}

/// Bytes a DecodeStep keeps in memory while it runs: the request, and the outputs the response
/// holds (O is q's size; LSE LseBytesAtMost).
/// Saturates at 2^62 (millions of items each claiming 2^40 bytes in a region overflowed the sum
/// before the item count was checked).
inline int64_t DecodeStepBytes(const v1::DecodeStepRequest& request) {
  constexpr int64_t kMost = int64_t{1} << 62;
  int64_t bytes = int64_t(request.ByteSizeLong());
  auto add = [&](int64_t n) { bytes = std::min(kMost, bytes + std::min(n, kMost)); };
  if (request.has_packed()) {  // O and LSE in the response unless in a region
    const v1::PackedDecodeRows& packed = request.packed();
    const int64_t q = QueryBytes(packed.q());
    if (!packed.has_out_shm()) add(q);
    if (request.return_lse() && !packed.has_lse_shm()) add(LseBytesAtMost(packed.q(), q));
    return bytes;
  }
  for (const v1::DecodeItem& item : request.items()) {
    const int64_t q = QueryBytes(item.q());
    if (!item.has_out_shm()) add(q);
    if (request.return_lse() && !item.has_lse_shm()) add(LseBytesAtMost(item.q(), q));
  }
  return bytes;
}

/// The same for an Attend: the request, O and LSE.
inline int64_t AttendBytes(const v1::AttendRequest& request) {
  const int64_t q = int64_t(request.q().data().size());
  return int64_t(request.ByteSizeLong()) + q +
         (request.return_lse() ? LseBytesAtMost(request.q(), q) : 0);
}

}  // namespace flashserve
