// Where a job's tensors are when its backend runs it: the one place that decides whether a
// request's bytes are copied on the host. Inputs stay where the edge says they arrived
// (TensorBytes) when the backend reads that memory directly (Backend::ReadsDirectly: the CUDA
// backend DMAs page-locked memory, the CPU backend reads any contiguous memory); otherwise they are
// copied once into request buffers (IoBuffers, from the backend's staging pool). Outputs go to the
// response message when the backend writes there well and the edge wants them there, else into
// request buffers (sent as slices by zero-copy edges, or copied into the response by
// CopyOutputsToResponse).
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "api/attention_problem.h"
#include "flashserve/v1/attention.pb.h"
#include "memory/io_buffers.h"
#include "memory/parallel_copy.h"
#include "memory/tensor_bytes.h"
#include "runtime/backend.h"

namespace flashserve {

/// What an edge says about one request's bytes.
struct TensorPlacementRequest {
  const AttentionProblem* problem = nullptr;
  TensorBytes inputs[3];  // q, k, v where they arrived
  // The edge sends O and LSE out of request buffers (IoBuffers) rather than the response message.
  bool outputs_in_buffers = false;
  // Buffers that already hold the inputs (inputs[] point into them) and have room for the
  // outputs (the striped edge reassembles uploads into them); may be null.
  std::shared_ptr<IoBuffers> io;
  v1::AttentionResponse* response = nullptr;  // where outputs go when not in buffers
  // O and LSE in a client's shared-memory region (data null: not in one). The backend writes
  // there when it can (WritesDirectly, aligned); else the result is copied there once it is done.
  TensorTarget regions[2];
};

/// Where the job's tensors ended up.
struct TensorPlacement {
  JobTensors tensors;
  std::shared_ptr<IoBuffers> io;  // the request buffers in use (null: none were needed)
  bool inputs_copied = false;     // the inputs were staged (one host copy)
  bool outputs_to_response = false;  // outputs are in `io` but belong in the response message
  int64_t stage_us = 0;           // time of the host copy
  // Output i (O, LSE) belongs in request.regions[i]: written there by the backend (in_region) or
  // copied there by CopyOutputsToRegions (copy_to_region).
  TensorTarget regions[2];
  bool in_region[2] = {false, false};
  bool copy_to_region[2] = {false, false};
};

/// Places a request's tensors for `backend` (see the file comment). RESOURCE_EXHAUSTED when no
/// host memory can be had for the buffers it needs. `copier` may be null (copies on this thread).
absl::StatusOr<TensorPlacement> PlaceTensors(TensorPlacementRequest request, Backend& backend,
                                            ParallelCopier* copier);

/// With placement.outputs_to_response: copies O (and LSE) from the request buffers into the
/// response message's data fields (the one host copy on the way out).
void CopyOutputsToResponse(const AttentionProblem& problem, const TensorPlacement& placement,
                           v1::AttentionResponse* response);

/// Copies each output marked copy_to_region from where the backend wrote it into its region.
void CopyOutputsToRegions(const TensorPlacement& placement);

}  // namespace flashserve
