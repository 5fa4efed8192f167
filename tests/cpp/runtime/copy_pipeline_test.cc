// The host-side plan of --copy_pipeline_chunks (runtime/copy_pipeline.h), no GPU needed: which jobs
// are pipelined, and that the chunks' parameters tile the heads exactly -- every query head once,
// with its own KV head, its O in place and its LSE in the chunk's contiguous block.
#include "runtime/copy_pipeline.h"

#include <vector>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

using kernels::AttentionParams;

constexpr size_t kElement = 2;  // bf16

struct Job {
  std::vector<char> q, k, v, o;
  std::vector<float> lse;
  JobTensors tensors;
  IoLayout layout;
  AttentionParams params;
};

// A bf16 problem with page-locked host tensors in one piece each (as staging gives them).
Job MakeJob(int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim) {
  Job j;
  j.params = kernels::make_contiguous_params(kernels::DType::kBFloat16, batch, seqlen_q, seqlen_k,
                                             heads_q, heads_kv, head_dim, false, 0.1f);
  const size_t q_bytes = size_t(batch) * seqlen_q * heads_q * head_dim * kElement;
  const size_t kv_bytes = size_t(batch) * seqlen_k * heads_kv * head_dim * kElement;
  j.q.resize(q_bytes);
  j.k.resize(kv_bytes);
  j.v.resize(kv_bytes);
  j.o.resize(q_bytes);
  j.lse.resize(size_t(batch) * heads_q * seqlen_q);
  j.tensors.q = TensorBytes::Contiguous(MemoryKind::kPageLocked, j.q.data(), q_bytes);
  j.tensors.k = TensorBytes::Contiguous(MemoryKind::kPageLocked, j.k.data(), kv_bytes);
  j.tensors.v = TensorBytes::Contiguous(MemoryKind::kPageLocked, j.v.data(), kv_bytes);
  j.tensors.o = {MemoryKind::kPageLocked, j.o.data(), q_bytes, -1};
  j.tensors.lse = {MemoryKind::kPageLocked, reinterpret_cast<char*>(j.lse.data()),
                   j.lse.size() * sizeof(float), -1};
  j.layout.q_bytes = q_bytes;
  j.layout.kv_bytes = kv_bytes;
  // Device-side pointers as the backend sets them (any distinct addresses do for the plan).
  static std::vector<char> device(1 << 20);
  j.params.q = device.data();
  j.params.k = device.data() + 1000;
  j.params.v = device.data() + 2000;
  j.params.o = device.data() + 3000;
  j.params.lse = reinterpret_cast<float*>(device.data() + 4096);
  return j;
}

TEST(CopyPipeline, OnlyLargeDenseJobsInOnePageLockedPieceEachArePipelined) {
  Job big = MakeJob(2, 1000, 1000, 12, 6, 128);  // 12 MiB of inputs
  EXPECT_EQ(PipelineChunks(big.params, big.tensors, big.layout, true, 4), 4);
  EXPECT_EQ(PipelineChunks(big.params, big.tensors, big.layout, true, 8), 6);   // <= heads_kv
  EXPECT_EQ(PipelineChunks(big.params, big.tensors, big.layout, true, 1), 1);   // off
  EXPECT_EQ(PipelineChunks(big.params, big.tensors, big.layout, false, 4), 1);  // no buffer
  Job small = MakeJob(1, 100, 100, 12, 6, 128);
  EXPECT_EQ(PipelineChunks(small.params, small.tensors, small.layout, true, 4), 1);
  Job one_kv = MakeJob(2, 2000, 2000, 8, 1, 128);
  EXPECT_EQ(PipelineChunks(one_kv.params, one_kv.tensors, one_kv.layout, true, 4), 1);
  Job heap = big;
  heap.tensors.k.kind = MemoryKind::kHeap;  // pageable: a 2D copy would go through staging
  EXPECT_EQ(PipelineChunks(heap.params, heap.tensors, heap.layout, true, 4), 1);
  Job pieces = big;
  pieces.tensors.v.pieces.push_back("x");  // gRPC receive buffers: many pieces
  EXPECT_EQ(PipelineChunks(pieces.params, pieces.tensors, pieces.layout, true, 4), 1);
  Job heap_out = big;
  heap_out.tensors.lse.kind = MemoryKind::kHeap;
  EXPECT_EQ(PipelineChunks(heap_out.params, heap_out.tensors, heap_out.layout, true, 4), 1);
  Job no_lse = big;
  no_lse.tensors.lse = {};
  EXPECT_EQ(PipelineChunks(no_lse.params, no_lse.tensors, no_lse.layout, true, 4), 4);
}

// Every query head belongs to exactly one chunk, with the KV head the full problem gives it, its
// O at the full problem's place, its LSE rows in the chunks' blocks laid end to end.
void ExpectChunksTile(const AttentionParams& p, int chunks) {
  SCOPED_TRACE(testing::Message() << "heads " << p.heads_q << ":" << p.heads_kv << ", " << chunks
                                  << " chunks");
  const int group = p.heads_q / p.heads_kv;
  int next_q = 0, next_kv = 0;
  const float* next_lse = p.lse;
  for (int c = 0; c < chunks; ++c) {
    const AttentionParams chunk = ChunkParams(p, chunks, c);
    ASSERT_GE(chunk.heads_kv, 1);
    EXPECT_EQ(chunk.heads_q, chunk.heads_kv * group);  // GQA groups stay whole
    const auto head_of = [&](const void* at, const void* base, int64_t head_stride) {
      return (static_cast<const char*>(at) - static_cast<const char*>(base)) /
             int64_t(head_stride * kElement);
    };
    EXPECT_EQ(head_of(chunk.q, p.q, p.q_head_stride), next_q);
    EXPECT_EQ(head_of(chunk.o, p.o, p.o_head_stride), next_q);
    EXPECT_EQ(head_of(chunk.k, p.k, p.k_head_stride), next_kv);
    EXPECT_EQ(head_of(chunk.v, p.v, p.v_head_stride), next_kv);
    EXPECT_EQ(chunk.lse, next_lse);
    EXPECT_EQ(chunk.q_row_stride, p.q_row_stride);  // still rows of the whole tensor
    EXPECT_EQ(chunk.k_batch_stride, p.k_batch_stride);
    next_q += chunk.heads_q;
    next_kv += chunk.heads_kv;
    next_lse += int64_t(p.batch) * chunk.heads_q * p.seqlen_q;
  }
  EXPECT_EQ(next_q, p.heads_q);
  EXPECT_EQ(next_kv, p.heads_kv);
  EXPECT_EQ(next_lse, p.lse + int64_t(p.batch) * p.heads_q * p.seqlen_q);
}

TEST(CopyPipeline, ChunksTileTheHeadsExactly) {
  for (auto [hq, hkv] : {std::pair{12, 6}, {5, 5}, {16, 2}, {32, 8}, {7, 7}, {64, 8}}) {
    Job j = MakeJob(3, 17, 29, hq, hkv, 64);
    for (int chunks = 1; chunks <= std::min(hkv, CopyPipeline::kMaxChunks); ++chunks) {
      ExpectChunksTile(j.params, chunks);
    }
  }
}

}  // namespace
}  // namespace flashserve
