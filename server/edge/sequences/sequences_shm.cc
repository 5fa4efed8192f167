#include "edge/sequences/sequences_shm.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "edge/sequences/sequences_convert.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

void InitSequenceShm(ShmRegistry* regions, const SequenceRuntime* sequences, SequenceShm* shm) {
  shm->regions = regions;
  shm->store_device = sequences == nullptr ? -1 : sequences->store_device();
}

namespace {

// The span `ref` names, from the call's one lease of its region (taken on first use).
absl::StatusOr<ShmSpan> LeaseOnce(const v1::SharedMemoryRef& ref, SequenceShm* shm) {
  const ShmSpan* whole = nullptr;
  for (const auto& [region, span] : shm->regions_leased) {
    if (region == ref.region()) whole = &span;
  }
  if (whole == nullptr) {
    absl::StatusOr<ShmSpan> leased = shm->regions->LeaseWhole(ref.region(), /*owner=*/"");
    if (!leased.ok()) return leased.status();
    shm->leases.push_back(leased->lease);
    shm->regions_leased.emplace_back(ref.region(), *std::move(leased));
    whole = &shm->regions_leased.back().second;
  }
  return ShmRegistry::SubSpan(*whole, ref.region(), ref.offset(), ref.byte_size());
}

absl::StatusOr<ShmSpan> LeaseSpan(const v1::SharedMemoryRef& ref, const char* name,
                                  SequenceShm* shm) {
  if (shm->regions == nullptr || !shm->regions->enabled()) {
    return absl::PermissionDeniedError(absl::StrCat(
        name, ": shared memory is disabled on this server (start it with --allow_client_shm)"));
  }
  absl::StatusOr<ShmSpan> span = LeaseOnce(ref, shm);
  if (!span.ok()) {
    return absl::Status(span.status().code(), absl::StrCat(name, ": ", span.status().message()));
  }
  if (span->kind == MemoryKind::kDevice && shm->store_device < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        name, ": region '", ref.region(), "' is CUDA memory, but this server's KV cache is in "
        "host memory (CPU backend); use a system region"));
  }
  if (span->kind == MemoryKind::kDevice && span->device != shm->store_device) {
    return absl::FailedPreconditionError(absl::StrCat(
        name, ": region '", ref.region(), "' is on CUDA device ", span->device,
        ", the KV cache on device ", shm->store_device,
        "; register a region on the KV cache's device (or use a system region)"));
  }
  return span;
}

kvcache::BytesAt PlaceOf(const ShmSpan& span) {
  switch (span.kind) {
    case MemoryKind::kDevice: return kvcache::BytesAt::kDevice;
    case MemoryKind::kPageLocked: return kvcache::BytesAt::kPageLocked;
    default: return kvcache::BytesAt::kHost;
  }
}

}  // namespace

absl::StatusOr<kvcache::HostRows> ShmRows(const v1::Tensor& tensor, const char* name,
                                          SequenceShm* shm) {
  if (!tensor.data().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": give either data or shm, not both"));
  }
  absl::StatusOr<ShmSpan> span = LeaseSpan(tensor.shm(), name, shm);
  if (!span.ok()) return span.status();
  absl::StatusOr<kvcache::HostRows> rows =
      RowsFromBytes(tensor, name, span->data, int64_t(span->bytes));
  if (!rows.ok()) return rows;
  rows->at = PlaceOf(*span);
  shm->inputs.emplace_back(span->data, span->data + span->bytes);
  (span->kind == MemoryKind::kDevice ? shm->cuda_inputs : shm->system_inputs) = true;
  return rows;
}

absl::StatusOr<ShmPlace> ShmOutput(const v1::SharedMemoryRef& ref, const char* name, int64_t bytes,
                                int alignment, SequenceShm* shm) {
  if (ref.byte_size() != uint64_t(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": shm byte_size ", ref.byte_size(),
                                                   " != the output's ", bytes, " bytes"));
  }
  absl::StatusOr<ShmSpan> span = LeaseSpan(ref, name, shm);
  if (!span.ok()) return span.status();
  if (reinterpret_cast<uintptr_t>(span->data) % uintptr_t(alignment) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": must start at a multiple of ", alignment, " bytes in the region"));
  }
  shm->outputs.emplace_back(span->data, span->data + span->bytes);
  return ShmPlace{span->data, PlaceOf(*span)};
}

absl::Status CheckShmOverlap(const SequenceShm& shm) {
  if (shm.outputs.empty()) return absl::OkStatus();
  // Sorted by start: a span overlaps an earlier one iff it starts before that one's end.
  struct Span {
    const char* begin;
    const char* end;
    bool output;
  };
  std::vector<Span> spans;
  for (const auto& [b, e] : shm.inputs) spans.push_back({b, e, false});
  for (const auto& [b, e] : shm.outputs) spans.push_back({b, e, true});
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  const char* any_end = nullptr;     // furthest end of the spans so far
  const char* output_end = nullptr;  // furthest end of the output spans so far
  for (const Span& s : spans) {
    if (s.begin == s.end) continue;
    const bool hits_output = output_end != nullptr && s.begin < output_end;
    const bool output_hits = s.output && any_end != nullptr && s.begin < any_end;
    if (hits_output || output_hits) {
      return absl::InvalidArgumentError(
          "a shared-memory output (out_shm / lse_shm) overlaps another tensor of the call");
    }
    if (any_end == nullptr || s.end > any_end) any_end = s.end;
    if (s.output && (output_end == nullptr || s.end > output_end)) output_end = s.end;
  }
  return absl::OkStatus();
}

}  // namespace flashserve
