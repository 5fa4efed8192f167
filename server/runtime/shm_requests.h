// What both edges do with clients' shared-memory regions (Triton's shared-memory extension):
// resolve a request's references (region, offset, byte size) into leased TensorBytes and
// TensorTargets of its call, and register / unregister regions with the metrics kept current.
// The registry and its rules: memory/shm_regions.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "memory/shm_regions.h"
#include "metrics/server_metrics.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

/// Where a request says one tensor is: Triton's shared_memory_region / _offset / _byte_size.
struct ShmReference {
  std::string region;  // empty: not in shared memory
  uint64_t offset = 0;
  uint64_t byte_size = 0;
  bool set() const { return !region.empty(); }
};

/// One request's references: inputs Q, K, V and outputs O, LSE.
struct ShmReferences {
  ShmReference inputs[3];
  ShmReference outputs[2];
  bool any() const;
  bool any_output() const { return outputs[0].set() || outputs[1].set(); }
};

/// The references of a native request (Tensor.shm, out_shm, lse_shm).
ShmReferences NativeShmReferences(const v1::AttentionRequest& request);

/// The leases a call holds on regions. The edge keeps them until the call's done() and drops them
/// before it answers, so a client that unregisters after its answer never finds them in use.
using ShmLeases = std::vector<std::shared_ptr<void>>;

/// Points `call` at the regions `refs` names (inputs not in a region: where call->inputs says, or
/// the request message's data fields) and takes their leases; an input both given and named in a
/// region is refused, and so is an output that overlaps an input or the other output (compared in
/// the memory itself: two names for one object do not hide it). Errors name the tensor: no such
/// region, outside it, overlapping, shared memory disabled. `call->request` must be set.
absl::Status AttachShm(AttentionRuntime& runtime, const ShmReferences& refs,
                       absl::string_view owner, AttentionRuntime::Call* call, ShmLeases* leases);

/// Gives a finished call's leases back (before its answer) and returns the status to answer:
/// `status`, or, when it is OK but one of the call's regions stopped being the client's memory
/// while the call used it (ShmRegistry::CheckLease: the object was cut short), that error.
absl::Status ReleaseShmLeases(absl::Status status, ShmLeases* leases);

/// The registry's calls, with flashserve_shm_regions / _region_bytes set afterwards. A runtime
/// without a registry refuses them as disabled.
absl::Status RegisterSystemShm(AttentionRuntime& runtime, absl::string_view name,
                               absl::string_view key, uint64_t offset, uint64_t byte_size,
                               absl::string_view owner);
absl::Status RegisterCudaShm(AttentionRuntime& runtime, absl::string_view name,
                             absl::string_view raw_handle, int64_t device, uint64_t byte_size,
                             absl::string_view owner);
absl::Status UnregisterShm(AttentionRuntime& runtime, ShmType type, absl::string_view name,
                           absl::string_view owner);
absl::StatusOr<std::vector<ShmRegionInfo>> ShmStatus(AttentionRuntime& runtime, ShmType type,
                                                     absl::string_view name,
                                                     absl::string_view owner);

}  // namespace flashserve
