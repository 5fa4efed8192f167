// DecodeStep items whose q/k/v or O/LSE live in a client's shared-memory region (Tensor.shm,
// DecodeItem.out_shm / lse_shm): leases the spans, checks their sizes, and refuses an output
// that overlaps another tensor of the call (the CPU store reads q while it writes O).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "flashserve/v1/sequences.pb.h"
#include "kvcache/kv_types.h"
#include "kvcache/sequence_cache.h"
#include "memory/shm_regions.h"
#include "runtime/decode_call.h"
#include "runtime/shm_requests.h"

namespace flashserve {

/// One call's spans in shared memory. Keep its leases (regions_leased) until the call's outputs
/// are written.
struct SequenceShm {
  ShmRegistry* regions = nullptr;  // null: shared memory disabled
  int store_device = -1;           // the KV store's CUDA device (-1: it reads host memory only)
  std::vector<ShmUse> uses;  // each tensor in a region, for CheckShmOverlap
  // Some input came from a system / a CUDA region (DecodeCall's request_inputs_total paths).
  bool system_inputs = false, cuda_inputs = false;
  // Each region the call names, leased once as a whole (a step names one or two regions
  // 5 x items times; leasing every span took a lookup and an fstat each). Each whole span holds
  // the call's only lease on its region.
  std::vector<std::pair<std::string, ShmSpan>> regions_leased;
  // With any region leased: the items that append rows (FinishSequenceShm releases their
  // sequences), until KeepAppended keeps those the call did append to.
  struct FedItem {
    size_t item;
    std::string id;
  };
  std::vector<FedItem> fed;

  /// Keeps in `fed` only the items the call appended rows to, from its report: none when it
  /// failed before its launch (an empty report), not those found appended already (a retry).
  void KeepAppended(const DecodeReport& report);

  /// Gives every region back once the call's outputs are in place, before its answer (a client
  /// that unregisters after reading it must find no lease). OK unless one of them stopped being
  /// the client's memory while the call used it (ShmRegistry::CheckLease).
  absl::Status ReleaseLeases();
};

/// Gives a finished call's regions back (before its answer) and returns the status to answer:
/// `status`, or the error of a region that stopped being the client's memory while the call used
/// it. Then the sequences the call appended rows to (`fed`, after KeepAppended) are released
/// (`cache`) and the answer says so: rows read from a faulted region may be zeros instead of the
/// client's, and a call that fails must not leave rows behind either way (a retry would append
/// them twice), so the client's next call finds them gone (NOT_FOUND) and re-creates them, as
/// after an eviction. A call that appended nothing releases nothing.
absl::Status FinishSequenceShm(absl::Status status, SequenceShm* shm,
                               kvcache::SequenceCache* cache);

class SequenceRuntime;
/// Readies `shm` for one call on a server with these regions (null: shared memory off) and this
/// Sequences runtime (null: none): both transports call it, so they resolve regions alike.
void InitSequenceShm(ShmRegistry* regions, const SequenceRuntime* sequences, SequenceShm* shm);

/// A span the KV store can use where it is: where its bytes live and their address.
struct ShmPlace {
  char* data = nullptr;
  kvcache::BytesAt at = kvcache::BytesAt::kHost;
};

/// q/k/v rows from the region `tensor.shm` names (data must be empty; dtype and shape set).
/// PERMISSION_DENIED when shared memory is off; FAILED_PRECONDITION for a CUDA region on
/// another device than the KV store's, or when the store is in host memory.
absl::StatusOr<kvcache::HostRows> ShmRows(const v1::Tensor& tensor, const char* name,
                                          SequenceShm* shm);
/// Where to write an output of exactly `bytes` bytes (the reference must name that many),
/// starting at a multiple of `alignment` (LSE is written as floats).
absl::StatusOr<ShmPlace> ShmOutput(const v1::SharedMemoryRef& ref, const char* name, int64_t bytes,
                                int alignment, SequenceShm* shm);
/// INVALID_ARGUMENT naming both when an output span overlaps another input or output span, in
/// the memory itself (two names for one shm object do not hide an overlap).
absl::Status CheckShmOverlap(const SequenceShm& shm);

}  // namespace flashserve
