#include "runtime/cuda_transfer.h"

#include <array>

namespace flashserve {
namespace {

bool AnyDevice(const JobTensors& t) {
  return t.q.kind == MemoryKind::kDevice || t.k.kind == MemoryKind::kDevice ||
         t.v.kind == MemoryKind::kDevice;
}

// q | k | v contiguous at the device layout's offsets in one host buffer.
bool InDeviceLayout(const JobTensors& t, const IoLayout& layout) {
  if (AnyDevice(t)) return false;
  if (!t.q.contiguous() || !t.k.contiguous() || !t.v.contiguous()) return false;
  const char* q = t.q.data();
  return t.k.data() == q + layout.k_offset && t.v.data() == q + layout.v_offset;
}

// Queues every piece as one batch, which costs the host far less than one cudaMemcpyAsync per
// piece (gRPC reads 64 KiB at a time: a 48 MiB request is ~770 pieces); piece by piece where
// batches are not supported.
cudaError_t CopyPieces(const std::array<const TensorBytes*, 3>& tensors,
                       const std::array<size_t, 3>& offsets, char* device, cudaStream_t stream,
                       BatchCopy* batch) {
  batch->dsts.clear();
  batch->srcs.clear();
  batch->sizes.clear();
  for (size_t i = 0; i < 3; ++i) {
    char* dest = device + offsets[i];
    for (std::string_view piece : tensors[i]->pieces) {
      if (piece.empty()) continue;
      batch->dsts.push_back(dest);
      batch->srcs.push_back(piece.data());
      batch->sizes.push_back(piece.size());
      dest += piece.size();
    }
  }
  if (batch->dsts.empty()) return cudaSuccess;
  cudaMemcpyAttributes attributes = {};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attribute_index = 0;
  cudaError_t e = cudaMemcpyBatchAsync(batch->dsts.data(), batch->srcs.data(), batch->sizes.data(),
                                       batch->dsts.size(), &attributes, &attribute_index, 1, stream);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  cudaGetLastError();
  for (size_t i = 0; i < batch->dsts.size(); ++i) {
    e = cudaMemcpyAsync(batch->dsts[i], batch->srcs[i], batch->sizes[i], cudaMemcpyHostToDevice,
                        stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

// One tensor from (or to) device memory of another GPU: one peer copy.
cudaError_t PeerCopy(void* dst, int dst_device, const void* src, int src_device, size_t bytes,
                     cudaStream_t stream) {
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream);
}

cudaError_t QueueInputCopies(const JobTensors& tensors, const IoLayout& layout, char* device,
                             int device_index, cudaStream_t stream, BatchCopy* batch) {
  if (device == nullptr) return cudaSuccess;  // no buffer: every tensor is on this device
  // Per-copy latency is most of a small request's H2D: one copy when the layout allows it.
  if (InDeviceLayout(tensors, layout)) {
    return cudaMemcpyAsync(device, tensors.q.data(), layout.v_offset + layout.kv_bytes,
                           cudaMemcpyHostToDevice, stream);
  }
  const TensorBytes* all[3] = {&tensors.q, &tensors.k, &tensors.v};
  const size_t offsets[3] = {0, layout.k_offset, layout.v_offset};
  const TensorBytes none;
  std::array<const TensorBytes*, 3> host = {&none, &none, &none};
  for (int i = 0; i < 3; ++i) {
    if (all[i]->kind != MemoryKind::kDevice) {
      host[size_t(i)] = all[i];
    } else if (!OnDevice(*all[i], device_index)) {
      cudaError_t e = PeerCopy(device + offsets[i], device_index, all[i]->data(),
                               all[i]->device, size_t(all[i]->size()), stream);
      if (e != cudaSuccess) return e;
    }  // on this device: the kernel reads it in place
  }
  return CopyPieces(host, {offsets[0], offsets[1], offsets[2]}, device, stream, batch);
}

cudaError_t QueueOutputCopies(const JobTensors& tensors, const IoLayout& layout,
                              const char* device, int device_index, cudaStream_t stream) {
  if (device == nullptr) return cudaSuccess;  // no buffer: every tensor is on this device
  const TensorTarget& o = tensors.o;
  const TensorTarget& lse = tensors.lse;
  const size_t lse_gap = layout.lse_offset - layout.o_offset;
  const bool host_only = o.kind != MemoryKind::kDevice && lse.kind != MemoryKind::kDevice;
  // One copy when O and LSE lie back to back as on the device. Not across a gap between them: a
  // client's region may hold other data there (only request buffers are padded like the device).
  const bool back_to_back = lse.data == o.data + lse_gap && lse_gap == layout.q_bytes;
  if (host_only && (lse.data == nullptr || back_to_back)) {
    const size_t bytes = lse.data == nullptr ? layout.q_bytes : lse_gap + layout.lse_bytes;
    return cudaMemcpyAsync(o.data, device + layout.o_offset, bytes, cudaMemcpyDeviceToHost,
                           stream);
  }
  const TensorTarget* targets[2] = {&o, &lse};
  const size_t offsets[2] = {layout.o_offset, layout.lse_offset};
  const size_t sizes[2] = {layout.q_bytes, layout.lse_bytes};
  for (int i = 0; i < 2; ++i) {
    const TensorTarget& t = *targets[i];
    if (t.data == nullptr || OnDevice(t, device_index)) continue;  // not wanted / written there
    cudaError_t e = t.kind == MemoryKind::kDevice
                        ? PeerCopy(t.data, t.device, device + offsets[i], device_index, sizes[i],
                                   stream)
                        : cudaMemcpyAsync(t.data, device + offsets[i], sizes[i],
                                          cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace flashserve
