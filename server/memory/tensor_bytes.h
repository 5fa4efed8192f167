// Where a tensor's bytes live: the one description every edge, the runtime and every backend use.
// An edge says where a request's Q, K and V arrived (TensorBytes); the runtime decides whether they
// must be copied before a backend can read them (runtime/tensor_placement.h); a backend decides
// from the kind of memory alone how to reach them (the CUDA backend: DMA from page-locked memory,
// runtime/cuda_transfer.h). New places for tensor bytes are new MemoryKinds, not new code paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace flashserve {

/// The kinds of memory a tensor's bytes can be in.
enum class MemoryKind {
  kHeap,        // pageable host memory: protobuf strings, heap buffers, unlocked read buffers
  kPageLocked,  // page-locked host memory (receive arena, pinned pool, a client's system
                //   shared-memory region the CUDA backend registered): a GPU DMAs it directly
  kDevice,      // GPU memory of device `device` (a client's CUDA shared-memory region, opened
                //   from its IPC handle): the CUDA backend reads / writes it where it is
};

/// "heap", "page_locked" (logs and tests).
const char* MemoryKindName(MemoryKind kind);

/// One input tensor's bytes: pieces, in order, all in one kind of memory (read-only). A tensor
/// parsed from gRPC's receive buffers is many pieces; one in a single buffer is one piece.
struct TensorBytes {
  MemoryKind kind = MemoryKind::kHeap;
  std::vector<std::string_view> pieces;
  int device = -1;  // kDevice: the GPU the pieces are on

  static TensorBytes Contiguous(MemoryKind kind, const void* data, size_t bytes);
  /// Pieces of gRPC's receive buffers: page-locked when every piece lies in the installed,
  /// page-locked receive arena (memory/receive_arena.h), else heap.
  static TensorBytes FromReceiveBuffers(std::vector<std::string_view> pieces);

  bool empty() const { return pieces.empty(); }
  int64_t size() const;
  /// One piece (or none): data() is the whole tensor.
  bool contiguous() const { return pieces.size() <= 1; }
  const char* data() const { return pieces.empty() ? nullptr : pieces.front().data(); }
};

/// One output tensor's destination: one writable span.
struct TensorTarget {
  MemoryKind kind = MemoryKind::kHeap;
  char* data = nullptr;  // nullptr: not wanted (LSE not asked for)
  size_t bytes = 0;
  int device = -1;  // kDevice: the GPU it is on
};

/// Where one job's tensors are when a backend runs it.
///   q: [batch, seqlen_q, heads_q, head_dim], k/v: [batch, seqlen_k, heads_kv, head_dim],
///   o: like q, lse: float32 [batch, heads_q, seqlen_q] (or no data). Row-major, contiguous.
struct JobTensors {
  TensorBytes q, k, v;
  TensorTarget o, lse;
};

}  // namespace flashserve
