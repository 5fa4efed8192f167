// A large request's copies overlapped with its kernel (--copy_pipeline_chunks). The heads are cut
// into chunks on KV-head boundaries (a GQA group stays whole); chunk c's Q/K/V go to the device
// while chunk c-1's kernel runs and chunk c-2's O/LSE come back, on three streams, so the H2D and
// D2H copy engines and the SMs work at once. The request then takes about its input copy plus the
// last chunk's kernel and output copy, instead of input copy, kernel and output copy in a row.
// Only for host tensors in one page-locked piece each (staged requests, system shared-memory
// regions): each tensor of a chunk is one 2D copy (its heads' slice of every row). The CUDA backend
// pipelines only a job alone on its device: under load the narrower copies cost throughput.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "flashserve/kernels/attention_params.h"
#include "memory/io_buffers.h"
#include "memory/tensor_bytes.h"

namespace flashserve {

/// Inputs below this are not pipelined: their copies take about what the extra launches and the
/// narrower copies cost.
inline constexpr int64_t kPipelineMinInputBytes = int64_t{8} << 20;

/// The chunks a job is cut into: 1 (not pipelined) unless max_chunks > 1, the job has a device
/// buffer, every tensor is host memory in one page-locked piece, the problem is dense (not
/// varlen) with >= 2 KV heads and inputs >= kPipelineMinInputBytes; then
/// min(max_chunks, heads_kv, CopyPipeline::kMaxChunks).
int PipelineChunks(const kernels::AttentionParams& p, const JobTensors& tensors,
                   const IoLayout& layout, bool device_buffer, int max_chunks);

/// Chunk c of `chunks`: KV heads [c*hk/chunks, (c+1)*hk/chunks) and their query heads. Pointers
/// move to the chunk's first head, strides stay; the chunk's LSE is written contiguously
/// ([batch, its heads, seqlen_q]) at its place in the LSE buffer (the chunks' blocks in order).
kernels::AttentionParams ChunkParams(const kernels::AttentionParams& p, int chunks, int c);

/// What a pipelined job queues. `params` point at the job's device buffer `base`; `launch` queues
/// the kernel for (chunk) params on a stream.
struct PipelineWork {
  const JobTensors* tensors = nullptr;
  const IoLayout* layout = nullptr;
  char* base = nullptr;
  kernels::AttentionParams params;
  int chunks = 1;
  std::function<cudaError_t(const kernels::AttentionParams&, cudaStream_t)> launch;
};

/// A slot's second and third streams and the per-chunk events, made on its first pipelined job.
class CopyPipeline {
 public:
  static constexpr int kMaxChunks = 8;
  /// On the current device.
  static absl::StatusOr<std::unique_ptr<CopyPipeline>> Create();
  ~CopyPipeline();
  CopyPipeline(const CopyPipeline&) = delete;
  CopyPipeline& operator=(const CopyPipeline&) = delete;

  /// Queues every chunk: inputs on `stream` (the slot's), kernels on the compute stream, outputs
  /// on the copy-out stream; `inputs_done` is recorded on `stream` after the last input copy,
  /// `kernels_done` after the last kernel. Whatever happens, `stream` then waits for all that was
  /// queued, so what follows on it (timing events, the buffer's free) comes after it. Returns the
  /// first failure (`*what` names its step) or cudaSuccess.
  cudaError_t Queue(const PipelineWork& work, cudaStream_t stream, cudaEvent_t inputs_done,
                    cudaEvent_t kernels_done, const char** what);

 private:
  CopyPipeline() = default;
  cudaError_t QueueChunk(const PipelineWork& work, int c, cudaStream_t stream, const char** what);

  cudaStream_t compute_ = nullptr, copy_out_ = nullptr;
  cudaEvent_t inputs_[kMaxChunks] = {}, kernels_[kMaxChunks] = {};
  cudaEvent_t compute_idle_ = nullptr, copy_out_idle_ = nullptr;
};

}  // namespace flashserve
