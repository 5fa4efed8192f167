#include "runtime/tensor_placement.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace flashserve {
namespace {

MemoryKind KindOf(const IoBuffers& io) {
  return io.pinned() ? MemoryKind::kPageLocked : MemoryKind::kHeap;
}

// Copies q, k and v (any pieces) into `io`'s input parts; not one in device memory (a client's
// CUDA region, which the backend reads where it is: a host copy of it would fault).
void StageInputs(const TensorBytes (&inputs)[3], const IoBuffers& io, ParallelCopier* copier) {
  std::vector<CopyPiece> pieces;
  char* dest[3] = {io.q(), io.k(), io.v()};
  for (int i = 0; i < 3; ++i) {
    if (inputs[i].kind == MemoryKind::kDevice) continue;
    for (std::string_view piece : inputs[i].pieces) {
      pieces.push_back({dest[i], piece.data(), piece.size()});
      dest[i] += piece.size();
    }
  }
  if (copier != nullptr) {
    copier->Copy(pieces);
  } else {
    for (const CopyPiece& p : pieces) std::memcpy(p.dest, p.src, p.bytes);
  }
}

void InputsFromBuffers(const IoBuffers& io, JobTensors* tensors) {
  const IoLayout& l = io.layout();
  const MemoryKind kind = KindOf(io);
  tensors->q = TensorBytes::Contiguous(kind, io.q(), l.q_bytes);
  tensors->k = TensorBytes::Contiguous(kind, io.k(), l.kv_bytes);
  tensors->v = TensorBytes::Contiguous(kind, io.v(), l.kv_bytes);
}

void OutputsToBuffers(const IoBuffers& io, JobTensors* tensors) {
  const IoLayout& l = io.layout();
  tensors->o = {KindOf(io), io.o(), l.q_bytes};
  if (l.lse_bytes > 0) tensors->lse = {KindOf(io), reinterpret_cast<char*>(io.lse()), l.lse_bytes};
}

void OutputsToResponse(const AttentionProblem& problem, v1::AttentionResponse* response,
                       const bool (&in_region)[2], JobTensors* tensors) {
  if (!in_region[0]) {
    std::string* out = response->mutable_out()->mutable_data();
    out->resize(size_t(problem.out_bytes()));
    tensors->o = {MemoryKind::kHeap, out->data(), out->size()};
  }
  if (problem.return_lse && !in_region[1]) {
    std::string* lse = response->mutable_lse()->mutable_data();
    lse->resize(size_t(problem.lse_elements()) * sizeof(float));
    tensors->lse = {MemoryKind::kHeap, lse->data(), lse->size()};
  }
}

// Device memory is never touched by a host copy: a backend that cannot reach it refuses, and an
// output there must suit the kernels' stores (O: 16-byte vectors; LSE: floats), which write it
// in place -- a misaligned store faults the GPU for every later request.
absl::Status CheckDeviceMemory(const TensorPlacementRequest& request, Backend& backend) {
  constexpr uintptr_t kAlign[2] = {16, 4};
  constexpr const char* kName[2] = {"O", "LSE"};
  for (int i = 0; i < 2; ++i) {
    const TensorTarget& target = request.regions[i];
    if (target.data != nullptr && target.kind == MemoryKind::kDevice &&
        reinterpret_cast<uintptr_t>(target.data) % kAlign[i] != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName[i], " in CUDA shared memory must start at a multiple of ", kAlign[i],
                       " bytes of the device's address space (its region's base plus offset)"));
    }
  }
  for (const TensorBytes& input : request.inputs) {
    if (input.kind == MemoryKind::kDevice && !backend.ReadsDirectly(input)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this backend cannot read an input on device ", input.device, " (CUDA shared memory)"));
    }
  }
  for (const TensorTarget& target : request.regions) {
    if (target.data != nullptr && target.kind == MemoryKind::kDevice &&
        !backend.WritesDirectly(target.kind)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "this backend cannot write an output on device ", target.device, " (CUDA shared memory)"));
    }
  }
  return absl::OkStatus();
}

// Outputs wanted in a client's region: written there directly when the backend can (host
// memory 16-byte aligned: the kernels store through typed pointers), else copied there after.
void PlaceRegionOutputs(const TensorPlacementRequest& request, TensorPlacement* placement) {
  const AttentionProblem& problem = *request.problem;
  TensorTarget* placed[2] = {&placement->tensors.o, &placement->tensors.lse};
  const size_t bytes[2] = {size_t(problem.out_bytes()),
                           size_t(problem.lse_elements()) * sizeof(float)};
  for (int i = 0; i < 2; ++i) {
    const TensorTarget& target = request.regions[i];
    if (target.data == nullptr || (i == 1 && !problem.return_lse)) continue;
    placement->regions[i] = target;
    if (placement->in_region[i]) {
      *placed[i] = {target.kind, target.data, bytes[i], target.device};
    } else {
      placement->copy_to_region[i] = true;
    }
  }
}

absl::Status NoHostMemory(const AttentionProblem& problem) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "cannot allocate ", IoLayout::For(problem).total, " bytes of host memory for this request"));
}

}  // namespace

absl::StatusOr<TensorPlacement> PlaceTensors(TensorPlacementRequest request, Backend& backend,
                                            ParallelCopier* copier) {
  const AttentionProblem& problem = *request.problem;
  TensorPlacement placement;
  RETURN_IF_ERROR(CheckDeviceMemory(request, backend));
  for (int i = 0; i < 2; ++i) {
    const TensorTarget& target = request.regions[i];
    placement.in_region[i] = target.data != nullptr && backend.WritesDirectly(target.kind) &&
                             (target.kind == MemoryKind::kDevice ||
                              reinterpret_cast<uintptr_t>(target.data) % 16 == 0);
  }
  bool direct = true;
  for (const TensorBytes& input : request.inputs) direct = direct && backend.ReadsDirectly(input);
  const bool response_ok = !request.outputs_in_buffers && backend.WritesDirectly(MemoryKind::kHeap);

  if (!direct) {
    // Staged: one copy into buffers laid out like the device's (one DMA each way on a GPU).
    placement.io = IoBuffers::Allocate(problem, backend.staging_pool());
    if (placement.io == nullptr) return NoHostMemory(problem);
    const absl::Time start = absl::Now();
    StageInputs(request.inputs, *placement.io, copier);
    placement.stage_us = absl::ToInt64Microseconds(absl::Now() - start);
    placement.inputs_copied = true;
    InputsFromBuffers(*placement.io, &placement.tensors);
    TensorBytes* staged[3] = {&placement.tensors.q, &placement.tensors.k, &placement.tensors.v};
    for (int i = 0; i < 3; ++i) {  // read where they are (StageInputs left them out)
      if (request.inputs[i].kind == MemoryKind::kDevice) *staged[i] = std::move(request.inputs[i]);
    }
  } else {
    placement.tensors.q = std::move(request.inputs[0]);
    placement.tensors.k = std::move(request.inputs[1]);
    placement.tensors.v = std::move(request.inputs[2]);
    if (!response_ok) {
      placement.io = request.io != nullptr
                         ? std::move(request.io)
                         : IoBuffers::AllocateOutputs(problem, backend.staging_pool());
      if (placement.io == nullptr) return NoHostMemory(problem);
    }
  }
  if (placement.io != nullptr && !(direct && response_ok)) {
    OutputsToBuffers(*placement.io, &placement.tensors);
    placement.outputs_to_response = !request.outputs_in_buffers;
  } else {
    OutputsToResponse(problem, request.response, placement.in_region, &placement.tensors);
  }
  PlaceRegionOutputs(request, &placement);
  return placement;
}

void CopyOutputsToResponse(const AttentionProblem& problem, const TensorPlacement& placement,
                           v1::AttentionResponse* response) {
  const JobTensors& t = placement.tensors;
  if (placement.regions[0].data == nullptr) {
    response->mutable_out()->mutable_data()->assign(t.o.data, size_t(problem.out_bytes()));
  }
  if (problem.return_lse && t.lse.data != nullptr && placement.regions[1].data == nullptr) {
    response->mutable_lse()->mutable_data()->assign(t.lse.data, t.lse.bytes);
  }
}

void CopyOutputsToRegions(const TensorPlacement& placement) {
  const TensorTarget* from[2] = {&placement.tensors.o, &placement.tensors.lse};
  for (int i = 0; i < 2; ++i) {
    if (!placement.copy_to_region[i]) continue;
    std::memcpy(placement.regions[i].data, from[i]->data, from[i]->bytes);
  }
}

}  // namespace flashserve
