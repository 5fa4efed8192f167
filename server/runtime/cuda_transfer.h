// Host <-> device copies of one job, decided from where its tensors are (memory/tensor_bytes.h):
// one copy for inputs laid out like the device buffer (request buffers: IoLayout), a batch copy
// for inputs in many page-locked pieces (gRPC's receive buffers in the receive arena), one copy
// per tensor otherwise; outputs in one copy when O and LSE sit as on the device. Tensors in
// device memory (kDevice: a client's CUDA shared-memory region) on the job's device are not
// copied at all (the kernel reads / writes them where they are: PointAtDeviceTensors); on another
// device, one peer copy. Everything is queued on the caller's stream; nothing here waits.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "memory/io_buffers.h"
#include "memory/tensor_bytes.h"

namespace flashserve {

/// The argument arrays of one batch copy, kept by a stream's slot so launches reuse their memory.
struct BatchCopy {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};

/// True when the tensor is device memory of GPU `device_index`: used in place, never copied.
inline bool OnDevice(const TensorBytes& t, int device_index) {
  return t.kind == MemoryKind::kDevice && t.device == device_index;
}
inline bool OnDevice(const TensorTarget& t, int device_index) {
  return t.kind == MemoryKind::kDevice && t.data != nullptr && t.device == device_index;
}

/// Queues the copies of q, k and v to `device` (laid out by `layout`) on GPU `device_index`;
/// `device` null (no buffer: every tensor is on that GPU) copies nothing.
cudaError_t QueueInputCopies(const JobTensors& tensors, const IoLayout& layout, char* device,
                             int device_index, cudaStream_t stream, BatchCopy* batch);

/// Queues the copies of O (and LSE when wanted) from `device` to their targets.
cudaError_t QueueOutputCopies(const JobTensors& tensors, const IoLayout& layout,
                              const char* device, int device_index, cudaStream_t stream);

}  // namespace flashserve
