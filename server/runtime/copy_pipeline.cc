#include "runtime/copy_pipeline.h"

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "flashserve/kernels/dtype.h"

namespace flashserve {
namespace {

bool OnePageLockedPiece(const TensorBytes& t) {
  return t.kind == MemoryKind::kPageLocked && t.contiguous() && !t.empty();
}

// KV heads [first, end) of chunk c.
struct HeadRange {
  int first = 0, end = 0;
};
HeadRange KvHeadsOf(int heads_kv, int chunks, int c) {
  return {c * heads_kv / chunks, (c + 1) * heads_kv / chunks};
}

// One slice of heads of every row of a [rows, heads, head_dim] tensor: a 2D copy whose rows are
// the tensor's rows and whose width is the slice.
struct HeadSlice {
  size_t offset = 0;  // bytes from the tensor's start to the slice's first element
  size_t width = 0;   // bytes of one row's slice
  size_t pitch = 0;   // bytes of one whole row
  size_t rows = 0;
};
HeadSlice SliceOf(int heads, int first, int end, int head_dim, size_t element, size_t rows) {
  const size_t head_bytes = size_t(head_dim) * element;
  return {size_t(first) * head_bytes, size_t(end - first) * head_bytes, size_t(heads) * head_bytes,
          rows};
}

cudaError_t CopySlice(char* dst, const char* src, const HeadSlice& s, cudaMemcpyKind kind,
                      cudaStream_t stream) {
  return cudaMemcpy2DAsync(dst + s.offset, s.pitch, src + s.offset, s.pitch, s.width, s.rows, kind,
                           stream);
}

}  // namespace

int PipelineChunks(const kernels::AttentionParams& p, const JobTensors& tensors,
                   const IoLayout& layout, bool device_buffer, int max_chunks) {
  if (max_chunks < 2 || !device_buffer || p.varlen() || p.heads_kv < 2) return 1;
  if (!OnePageLockedPiece(tensors.q) || !OnePageLockedPiece(tensors.k) ||
      !OnePageLockedPiece(tensors.v)) {
    return 1;
  }
  if (tensors.o.kind != MemoryKind::kPageLocked || tensors.o.data == nullptr) return 1;
  if (tensors.lse.data != nullptr && tensors.lse.kind != MemoryKind::kPageLocked) return 1;
  if (int64_t(layout.q_bytes + 2 * layout.kv_bytes) < kPipelineMinInputBytes) return 1;
  return std::min({max_chunks, p.heads_kv, CopyPipeline::kMaxChunks});
}

kernels::AttentionParams ChunkParams(const kernels::AttentionParams& p, int chunks, int c) {
  const int group = p.heads_q / p.heads_kv;
  const HeadRange kv = KvHeadsOf(p.heads_kv, chunks, c);
  const int64_t first_q = int64_t{kv.first} * group;
  const size_t element = kernels::dtype_size(p.dtype);
  kernels::AttentionParams chunk = p;
  chunk.heads_kv = kv.end - kv.first;
  chunk.heads_q = chunk.heads_kv * group;
  chunk.q = static_cast<const char*>(p.q) + first_q * p.q_head_stride * element;
  chunk.o = static_cast<char*>(p.o) + first_q * p.o_head_stride * element;
  chunk.k = static_cast<const char*>(p.k) + kv.first * p.k_head_stride * element;
  chunk.v = static_cast<const char*>(p.v) + kv.first * p.v_head_stride * element;
  if (p.lse != nullptr) chunk.lse = p.lse + int64_t{p.batch} * first_q * p.seqlen_q;
  return chunk;
}

absl::StatusOr<std::unique_ptr<CopyPipeline>> CopyPipeline::Create() {
  std::unique_ptr<CopyPipeline> pipeline(new CopyPipeline());
  cudaError_t e = cudaStreamCreateWithFlags(&pipeline->compute_, cudaStreamNonBlocking);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&pipeline->copy_out_, cudaStreamNonBlocking);
  std::vector<cudaEvent_t*> events = {&pipeline->compute_idle_, &pipeline->copy_out_idle_};
  for (int i = 0; i < kMaxChunks; ++i) {
    events.push_back(&pipeline->inputs_[i]);
    events.push_back(&pipeline->kernels_[i]);
  }
  for (cudaEvent_t* event : events) {
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  }
  if (e != cudaSuccess) {
    return absl::UnavailableError(
        absl::StrCat("copy pipeline streams/events: ", cudaGetErrorString(e)));
  }
  return pipeline;
}

CopyPipeline::~CopyPipeline() {
  for (int i = 0; i < kMaxChunks; ++i) {
    if (inputs_[i] != nullptr) cudaEventDestroy(inputs_[i]);
    if (kernels_[i] != nullptr) cudaEventDestroy(kernels_[i]);
  }
  if (compute_idle_ != nullptr) cudaEventDestroy(compute_idle_);
  if (copy_out_idle_ != nullptr) cudaEventDestroy(copy_out_idle_);
  if (compute_ != nullptr) cudaStreamDestroy(compute_);
  if (copy_out_ != nullptr) cudaStreamDestroy(copy_out_);
}

// Chunk c: its inputs on `stream`, its kernel on compute_ once they are there, its outputs on
// copy_out_ once the kernel is done.
cudaError_t CopyPipeline::QueueChunk(const PipelineWork& work, int c, cudaStream_t stream,
                                     const char** what) {
  const kernels::AttentionParams& p = work.params;
  const JobTensors& t = *work.tensors;
  const IoLayout& layout = *work.layout;
  const size_t element = kernels::dtype_size(p.dtype);
  const HeadRange kv = KvHeadsOf(p.heads_kv, work.chunks, c);
  const int group = p.heads_q / p.heads_kv;
  const HeadSlice q = SliceOf(p.heads_q, kv.first * group, kv.end * group, p.head_dim, element,
                              size_t(p.batch) * size_t(p.seqlen_q));
  const HeadSlice k = SliceOf(p.heads_kv, kv.first, kv.end, p.head_dim, element,
                              size_t(p.batch) * size_t(p.seqlen_k));
  *what = "H2D copy (pipelined)";
  cudaError_t e = CopySlice(work.base, t.q.data(), q, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) {
    e = CopySlice(work.base + layout.k_offset, t.k.data(), k, cudaMemcpyHostToDevice, stream);
  }
  if (e == cudaSuccess) {
    e = CopySlice(work.base + layout.v_offset, t.v.data(), k, cudaMemcpyHostToDevice, stream);
  }
  if (e == cudaSuccess) e = cudaEventRecord(inputs_[c], stream);
  if (e != cudaSuccess) return e;
  *what = "kernel (pipelined)";
  e = cudaStreamWaitEvent(compute_, inputs_[c], 0);
  if (e == cudaSuccess) e = work.launch(ChunkParams(p, work.chunks, c), compute_);
  if (e == cudaSuccess) e = cudaEventRecord(kernels_[c], compute_);
  if (e != cudaSuccess) return e;
  *what = "D2H copy (pipelined)";
  e = cudaStreamWaitEvent(copy_out_, kernels_[c], 0);
  if (e == cudaSuccess) {
    e = CopySlice(t.o.data, work.base + layout.o_offset, q, cudaMemcpyDeviceToHost, copy_out_);
  }
  if (e == cudaSuccess && t.lse.data != nullptr) {
    // The chunk's LSE block [batch, its heads, seqlen_q] into its heads' rows of [batch, heads_q,
    // seqlen_q]: one 2D copy, a row per batch entry.
    const size_t row = size_t(p.seqlen_q) * sizeof(float);
    const size_t first_q = size_t(kv.first) * size_t(group);
    const size_t heads = size_t(kv.end - kv.first) * size_t(group);
    const char* block = work.base + layout.lse_offset + size_t(p.batch) * first_q * row;
    e = cudaMemcpy2DAsync(t.lse.data + first_q * row, size_t(p.heads_q) * row, block, heads * row,
                          heads * row, size_t(p.batch), cudaMemcpyDeviceToHost, copy_out_);
  }
  return e;
}

cudaError_t CopyPipeline::Queue(const PipelineWork& work, cudaStream_t stream,
                                cudaEvent_t inputs_done, cudaEvent_t kernels_done,
                                const char** what) {
  cudaError_t first = cudaSuccess;
  for (int c = 0; c < work.chunks && first == cudaSuccess; ++c) {
    first = QueueChunk(work, c, stream, what);
  }
  const char* failed = *what;
  auto keep = [&](cudaError_t e, const char* step) {
    if (e != cudaSuccess && first == cudaSuccess) {
      first = e;
      failed = step;
    }
  };
  // Always: `stream` must not run ahead of anything queued on the other two.
  keep(cudaEventRecord(inputs_done, stream), "cudaEventRecord");
  keep(cudaEventRecord(kernels_done, compute_), "cudaEventRecord");
  keep(cudaEventRecord(compute_idle_, compute_), "cudaEventRecord");
  keep(cudaEventRecord(copy_out_idle_, copy_out_), "cudaEventRecord");
  keep(cudaStreamWaitEvent(stream, compute_idle_, 0), "cudaStreamWaitEvent");
  keep(cudaStreamWaitEvent(stream, copy_out_idle_, 0), "cudaStreamWaitEvent");
  *what = failed;
  return first;
}

}  // namespace flashserve
