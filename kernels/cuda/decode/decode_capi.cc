// C ABI over the decode kernels for ctypes (bench/kernels/bench_decode.py). Linked into
// flashserve_kernels_capi beside capi.cc. Raw pointers in; cudaError_t values (0 = success) out.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashserve/kernels/decode_attention.h"

namespace flashserve::kernels::cuda::decode {
int& l2_prefetch_override();  // decode_dispatch.cu
int& copy_override();
int& pdl_override();
int& deep_issue_override();
int& last_copy();
int& tma_wide_override();
int& wide_tiles_override();
int& last_block_n();
int& last_stages();
int& fused_merge_override();  // decode_merge_plan.cu
int& last_merge();
}  // namespace flashserve::kernels::cuda::decode

namespace {

namespace fk = flashserve::kernels::cuda;
using flashserve::kernels::DType;

struct DecodeArgs {
  int dtype, batch, seqlen_q, seqlen_k, total_q, heads_q, heads_kv, head_dim, causal;
};

// strides: 12 element strides, (batch or page, row, head) for q, k, v, o in that order.
fk::DecodeParams make_params(const DecodeArgs& a, const int64_t* strides, float softmax_scale) {
  fk::DecodeParams p = fk::make_dense_decode_params(static_cast<DType>(a.dtype), a.batch,
                                                    a.seqlen_q, a.seqlen_k, a.heads_q, a.heads_kv,
                                                    a.head_dim, a.causal != 0, softmax_scale);
  p.total_q = a.total_q;
  if (strides != nullptr) {
    p.q_batch_stride = strides[0], p.q_row_stride = strides[1], p.q_head_stride = strides[2];
    p.k_batch_stride = strides[3], p.k_row_stride = strides[4], p.k_head_stride = strides[5];
    p.v_batch_stride = strides[6], p.v_row_stride = strides[7], p.v_head_stride = strides[8];
    p.o_batch_stride = strides[9], p.o_row_stride = strides[10], p.o_head_stride = strides[11];
  }
  return p;
}

}  // namespace

extern "C" {

/// Decode attention (flashserve::kernels::cuda::run_decode). cu_seqlens_q / cu_seqlens_k /
/// seqlens_k / block_table: device int32 arrays or null (DecodeParams says when each is used);
/// page_size and block_table_stride only when paged. num_splits 0 = heuristic. workspace may be
/// null (allocated stream-ordered). stream: a cudaStream_t. Returns cudaError_t.
__attribute__((visibility("default"))) int flashserve_decode_forward(
    int dtype, const void* q, const void* k, const void* v, void* o, float* lse, int batch,
    int seqlen_q, int seqlen_k, int total_q, int heads_q, int heads_kv, int head_dim,
    const int64_t* strides, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const int32_t* seqlens_k, const int32_t* block_table, int64_t block_table_stride,
    int page_size, float softmax_scale, int causal, int num_splits, void* workspace,
    size_t workspace_bytes, void* stream) {
  fk::DecodeParams p = make_params(
      {dtype, batch, seqlen_q, seqlen_k, total_q, heads_q, heads_kv, head_dim, causal}, strides,
      softmax_scale);
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  p.cu_seqlens_q = cu_seqlens_q;
  p.cu_seqlens_k = cu_seqlens_k;
  p.seqlens_k = seqlens_k;
  p.block_table = block_table;
  p.block_table_stride = block_table_stride;
  p.page_size = page_size;
  p.num_splits = num_splits;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  return static_cast<int>(fk::run_decode(p, static_cast<cudaStream_t>(stream)));
}

/// Splits the heuristic picks (decode_num_splits) for a problem of these sizes, dense K/V
/// (page_size 0) or paged in pages of page_size keys: the count depends on the layout, so a
/// workspace must be sized for the layout it runs.
__attribute__((visibility("default"))) int flashserve_decode_num_splits(
    int dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
    int page_size, int sm_count) {
  fk::DecodeParams p = make_params(
      {dtype, batch, seqlen_q, seqlen_k, 0, heads_q, heads_kv, head_dim, 0}, nullptr, 1.0f);
  static const int32_t kMarker = 0;
  if (page_size > 0) {
    p.block_table = &kMarker;  // only says "paged"
    p.page_size = page_size;
  }
  return fk::decode_num_splits(p, sm_count);
}

/// decode_split_candidates: writes up to `capacity` split counts into out; returns how many exist.
__attribute__((visibility("default"))) int flashserve_decode_split_candidates(
    int dtype, int batch, int seqlen_q, int seqlen_k, int heads_q, int heads_kv, int head_dim,
    int sm_count, int* out, int capacity) {
  const fk::DecodeParams p = make_params(
      {dtype, batch, seqlen_q, seqlen_k, 0, heads_q, heads_kv, head_dim, 0}, nullptr, 1.0f);
  const std::vector<int> all = fk::decode_split_candidates(p, sm_count);
  for (int i = 0; i < static_cast<int>(all.size()) && i < capacity; ++i) out[i] = all[i];
  return static_cast<int>(all.size());
}

/// Workspace bytes for num_splits splits over total_q query rows.
__attribute__((visibility("default"))) size_t flashserve_decode_workspace_bytes(
    int dtype, int total_q, int heads_q, int head_dim, int num_splits) {
  const fk::DecodeParams p =
      make_params({dtype, 1, 1, 1, total_q, heads_q, heads_q, head_dim, 0}, nullptr, 1.0f);
  fk::DecodeParams varlen = p;
  static const int32_t kMarker = 0;
  varlen.cu_seqlens_q = &kMarker;  // only tells decode_workspace_bytes to use total_q
  return fk::decode_workspace_bytes(varlen, num_splits);
}

/// Benchmarking knob: the L2 prefetch hint of the decode kernels' K/V loads (0, 128 or 256
/// bytes; -1 restores the default). Not thread-safe against concurrent launches.
__attribute__((visibility("default"))) void flashserve_decode_set_l2_prefetch(int bytes) {
  flashserve::kernels::cuda::decode::l2_prefetch_override() = bytes;
}

/// Benchmarking knob: the decode kernels' K/V copy: 0 cp.async, 2 TMA boxes (sm_90 and later,
/// ignored elsewhere; falls back to cp.async for problems it cannot load, see
/// flashserve_decode_last_copy), -1 the default (TMA on sm_90+); 1 (removed bulk rows) = 0.
/// Not thread-safe against concurrent launches.
__attribute__((visibility("default"))) void flashserve_decode_set_copy(int mode) {
  flashserve::kernels::cuda::decode::copy_override() = mode;
}

/// Benchmarking knob: TMA boxes spanning every 64-column slice of a row when a page holds whole
/// key tiles (or K/V is dense): 0 no, 1 yes, -1 the default. Not thread-safe.
__attribute__((visibility("default"))) void flashserve_decode_set_tma_wide(int mode) {
  flashserve::kernels::cuda::decode::tma_wide_override() = mode;
}

/// Benchmarking knob: 128-key tiles for the head_dim 64 problems of <= 16 packed rows (query heads
/// per KV head x Sq): 0 never (64-key tiles), 1 always (also on pages < 64 keys), 2 / 3 always
/// with that many pipeline stages, -1 the default (dense K/V and pages >= 64 keys; 1 and -1 take
/// 2 stages for long key splits, else 3). Other head dims and row counts: 64-key tiles (32 above
/// 32 rows) whatever the mode. Not thread-safe.
__attribute__((visibility("default"))) void flashserve_decode_set_wide_tiles(int mode) {
  flashserve::kernels::cuda::decode::wide_tiles_override() = mode;
}

/// The K/V copy the calling thread's last decode launch used: 0 cp.async, 2 TMA, -1 none yet.
__attribute__((visibility("default"))) int flashserve_decode_last_copy() {
  return flashserve::kernels::cuda::decode::last_copy();
}

/// Keys per tile of the kernel the thread's last decode launch used (32, 64 or 128; 0 none yet).
__attribute__((visibility("default"))) int flashserve_decode_last_block_n() {
  return flashserve::kernels::cuda::decode::last_block_n();
}

/// Pipeline stages of the kernel the thread's last decode launch used (0 none yet).
__attribute__((visibility("default"))) int flashserve_decode_last_stages() {
  return flashserve::kernels::cuda::decode::last_stages();
}

/// Benchmarking knob: how split launches merge their partials: 0 the combine kernel, 1 in the
/// split kernel's last block per group up to the default's size limit, 2 there wherever its
/// shared memory holds them, -1 the default (1).
/// Not thread-safe against concurrent launches.
__attribute__((visibility("default"))) void flashserve_decode_set_fused_merge(int mode) {
  flashserve::kernels::cuda::decode::fused_merge_override() = mode;
}

/// How the thread's last decode launch merged its splits: 0 one split, 1 combine kernel, 2
/// in-kernel.
__attribute__((visibility("default"))) int flashserve_decode_last_merge() {
  return flashserve::kernels::cuda::decode::last_merge();
}

/// Benchmarking knob: programmatic dependent launch of the decode kernels (sm_90 and later;
/// ignored elsewhere): 0 off, 1 on, -1 the default. Not thread-safe against concurrent launches.
__attribute__((visibility("default"))) void flashserve_decode_set_pdl(int mode) {
  flashserve::kernels::cuda::decode::pdl_override() = mode;
}

/// Benchmarking knob: the K/V pipeline's issue order (1 deep: next tile issued before the wait,
/// 0 or -1 the default order). Not thread-safe against concurrent launches.
__attribute__((visibility("default"))) void flashserve_decode_set_deep_issue(int mode) {
  flashserve::kernels::cuda::decode::deep_issue_override() = mode;
}

}  // extern "C"
