#include "runtime/tensor_placement.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace flashserve {
namespace {

MemoryKind KindOf(const IoBuffers& io) {
  return io.pinned() ? MemoryKind::kPageLocked : MemoryKind::kHeap;
}

// Copies q, k and v (any pieces) into `io`'s input parts.
void StageInputs(const TensorBytes (&inputs)[3], const IoBuffers& io, ParallelCopier* copier) {
  std::vector<CopyPiece> pieces;
  char* dest[3] = {io.q(), io.k(), io.v()};
  for (int i = 0; i < 3; ++i) {
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
                       JobTensors* tensors) {
  std::string* out = response->mutable_out()->mutable_data();
  out->resize(size_t(problem.out_bytes()));
  tensors->o = {MemoryKind::kHeap, out->data(), out->size()};
  if (problem.return_lse) {
    std::string* lse = response->mutable_lse()->mutable_data();
    lse->resize(size_t(problem.lse_elements()) * sizeof(float));
    tensors->lse = {MemoryKind::kHeap, lse->data(), lse->size()};
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
    OutputsToResponse(problem, request.response, &placement.tensors);
  }
  return placement;
}

void CopyOutputsToResponse(const AttentionProblem& problem, const TensorPlacement& placement,
                           v1::AttentionResponse* response) {
  const JobTensors& t = placement.tensors;
  response->mutable_out()->mutable_data()->assign(t.o.data, size_t(problem.out_bytes()));
  if (problem.return_lse && t.lse.data != nullptr) {
    response->mutable_lse()->mutable_data()->assign(t.lse.data, t.lse.bytes);
  }
}

}  // namespace flashserve
