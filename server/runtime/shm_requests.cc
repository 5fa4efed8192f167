#include "runtime/shm_requests.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flashserve {
namespace {

constexpr const char* kInputNames[3] = {"Q", "K", "V"};
constexpr const char* kOutputNames[2] = {"O", "LSE"};

absl::Status Disabled() {
  return absl::PermissionDeniedError(
      "shared memory is disabled on this server (start it with --allow_client_shm)");
}

absl::StatusOr<ShmSpan> LeaseFor(ShmRegistry& registry, const char* tensor,
                                 const ShmReference& ref, absl::string_view owner) {
  absl::StatusOr<ShmSpan> span = registry.Lease(ref.region, ref.offset, ref.byte_size, owner);
  if (!span.ok()) {
    return absl::Status(span.status().code(),
                        absl::StrCat(tensor, ": ", span.status().message()));
  }
  return span;
}

void UpdateMetrics(AttentionRuntime& runtime) {
  ServerMetrics* metrics = runtime.metrics();
  ShmRegistry* registry = runtime.shm_regions();
  if (metrics == nullptr || registry == nullptr) return;
  for (ShmType type : {ShmType::kSystem, ShmType::kCuda}) {
    int64_t count = 0, bytes = 0;
    registry->Totals(type, &count, &bytes);
    metrics->SetShmRegions(ShmTypeName(type), count, bytes);
  }
}

}  // namespace

absl::Status ReleaseShmLeases(absl::Status status, ShmLeases* leases) {
  for (const std::shared_ptr<void>& lease : *leases) {
    if (!status.ok()) break;
    status = ShmRegistry::CheckLease(lease);
  }
  leases->clear();
  return status;
}

bool ShmReferences::any() const {
  for (const ShmReference& r : inputs) {
    if (r.set()) return true;
  }
  return outputs[0].set() || outputs[1].set();
}

ShmReferences NativeShmReferences(const v1::AttentionRequest& request) {
  ShmReferences refs;
  auto ref = [](const v1::SharedMemoryRef& r) {
    return ShmReference{r.region(), r.offset(), r.byte_size()};
  };
  const v1::Tensor* inputs[3] = {&request.q(), &request.k(), &request.v()};
  for (int i = 0; i < 3; ++i) {
    if (inputs[i]->has_shm()) refs.inputs[i] = ref(inputs[i]->shm());
  }
  if (request.has_out_shm()) refs.outputs[0] = ref(request.out_shm());
  if (request.has_lse_shm()) refs.outputs[1] = ref(request.lse_shm());
  return refs;
}

absl::Status AttachShm(AttentionRuntime& runtime, const ShmReferences& refs,
                       absl::string_view owner, AttentionRuntime::Call* call, ShmLeases* leases) {
  if (!refs.any()) return absl::OkStatus();
  ShmRegistry* registry = runtime.shm_regions();
  if (registry == nullptr || !registry->enabled()) return Disabled();
  const v1::AttentionRequest& request = *call->request;
  const v1::Tensor* messages[3] = {&request.q(), &request.k(), &request.v()};
  bool any_input = false, cuda = false, from_message[3] = {false, false, false};
  std::vector<ShmUse> uses;  // checked for overlaps before the call goes anywhere
  for (int i = 0; i < 3; ++i) {
    if (!refs.inputs[i].set()) {
      // Validation compares every input's bytes with its shape: name the message's own (unless
      // the edge said where they are already: the native edge's receive slices).
      if (call->inputs[i].empty()) {
        call->inputs[i] = TensorBytes::Contiguous(MemoryKind::kHeap, messages[i]->data().data(),
                                                  messages[i]->data().size());
        from_message[i] = true;
      }
      continue;
    }
    if (!call->inputs[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          kInputNames[i], ": data given together with a shared-memory reference (use one)"));
    }
    absl::StatusOr<ShmSpan> span = LeaseFor(*registry, kInputNames[i], refs.inputs[i], owner);
    if (!span.ok()) return span.status();
    call->inputs[i] = span->AsInput();
    leases->push_back(std::move(span->lease));
    uses.push_back(UseOf(*span, kInputNames[i], refs.inputs[i].region, refs.inputs[i].offset,
                         /*output=*/false));
    any_input = true;
    cuda = cuda || span->type == ShmType::kCuda;
  }
  if (!any_input) {
    for (int i = 0; i < 3; ++i) {
      if (from_message[i]) call->inputs[i] = TensorBytes();  // the usual way
    }
  }
  for (int i = 0; i < 2; ++i) {
    if (!refs.outputs[i].set()) continue;
    absl::StatusOr<ShmSpan> span = LeaseFor(*registry, kOutputNames[i], refs.outputs[i], owner);
    if (!span.ok()) return span.status();
    call->regions[i] = span->AsOutput();
    leases->push_back(std::move(span->lease));
    uses.push_back(UseOf(*span, kOutputNames[i], refs.outputs[i].region, refs.outputs[i].offset,
                         /*output=*/true));
  }
  // The whole range a reference names counts (an output's may be more than it needs).
  if (absl::Status s = CheckShmOverlaps(uses); !s.ok()) return s;
  if (any_input) call->shm_input_path = cuda ? "shm_cuda" : "shm_system";
  return absl::OkStatus();
}

absl::Status RegisterSystemShm(AttentionRuntime& runtime, absl::string_view name,
                               absl::string_view key, uint64_t offset, uint64_t byte_size,
                               absl::string_view owner) {
  if (runtime.shm_regions() == nullptr) return Disabled();
  absl::Status s = runtime.shm_regions()->RegisterSystem(name, key, offset, byte_size, owner);
  UpdateMetrics(runtime);
  return s;
}

absl::Status RegisterCudaShm(AttentionRuntime& runtime, absl::string_view name,
                             absl::string_view raw_handle, int64_t device, uint64_t byte_size,
                             absl::string_view owner) {
  if (runtime.shm_regions() == nullptr) return Disabled();
  absl::Status s = runtime.shm_regions()->RegisterCuda(name, raw_handle, device, byte_size, owner);
  UpdateMetrics(runtime);
  return s;
}

absl::Status UnregisterShm(AttentionRuntime& runtime, ShmType type, absl::string_view name,
                           absl::string_view owner) {
  if (runtime.shm_regions() == nullptr) return Disabled();
  absl::Status s = runtime.shm_regions()->Unregister(type, name, owner);
  UpdateMetrics(runtime);
  return s;
}

absl::StatusOr<std::vector<ShmRegionInfo>> ShmStatus(AttentionRuntime& runtime, ShmType type,
                                                     absl::string_view name,
                                                     absl::string_view owner) {
  if (runtime.shm_regions() == nullptr) return Disabled();
  return runtime.shm_regions()->Status(type, name, owner);
}

}  // namespace flashserve
