#include "edge/sequences/sequences_shm.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

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

absl::Status SequenceShm::ReleaseLeases() {
  absl::Status intact;
  for (const auto& [region, span] : regions_leased) {
    if (intact.ok()) intact = ShmRegistry::CheckLease(span.lease);
  }
  regions_leased.clear();
  return intact;
}

void SequenceShm::KeepAppended(const DecodeReport& report) {
  if (report.lengths.empty()) {  // done before a launch: nothing appended
    fed.clear();
    return;
  }
  fed.erase(std::remove_if(fed.begin(), fed.end(),
                           [&report](const FedItem& f) {
                             return f.item < report.already_appended.size() &&
                                    report.already_appended[f.item];
                           }),
            fed.end());
}

absl::Status FinishSequenceShm(absl::Status status, SequenceShm* shm,
                               kvcache::SequenceCache* cache) {
  absl::Status intact = shm->ReleaseLeases();
  if (intact.ok()) return status;
  if (cache == nullptr || shm->fed.empty()) return status.ok() ? intact : status;
  std::vector<std::string> ids;
  for (SequenceShm::FedItem& f : shm->fed) ids.push_back(std::move(f.id));
  cache->Release(ids);
  constexpr absl::string_view kReleased = "the sequences this call appended rows to were released";
  if (status.ok()) {
    return absl::Status(intact.code(), absl::StrCat(intact.message(), "; ", kReleased));
  }
  // The call failed after its launch (a device fault, or stopped mid-run): its own error first.
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), "; and ", intact.message(), ": ", kReleased));
}

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
  shm->uses.push_back(UseOf(*span, name, tensor.shm().region(), tensor.shm().offset(), false));
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
  shm->uses.push_back(UseOf(*span, name, ref.region(), ref.offset(), /*output=*/true));
  return ShmPlace{span->data, PlaceOf(*span)};
}

absl::Status CheckShmOverlap(const SequenceShm& shm) { return CheckShmOverlaps(shm.uses); }

}  // namespace flashserve
