#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flashserve/kernels/decode_attention.h"
#include "runtime/cuda_kv_store.h"
#include "runtime/kv_scatter.h"

// One decode launch over the pool: its inputs planned and packed, the kernel queued behind the
// staged writes, its outputs copied to where the items want them.

namespace flashserve {

namespace {

// Where the items' rows (q, or O) start when every item's lie back to back in item order in one
// kind of memory the device addresses, 16-byte aligned as the kernel reads them (a packed
// DecodeStep's region); else null.
template <typename Ptr>
Ptr PackedInPlace(const kvcache::PagedBatch& batch, const std::vector<int32_t>& cu_q,
                  int64_t row_bytes, Ptr kvcache::PagedItem::*rows,
                  kvcache::BytesAt kvcache::PagedItem::*at, bool addressable) {
  const char* base = static_cast<const char*>(batch.items[0].*rows);
  if (!addressable || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) {
    return nullptr;
  }
  for (size_t b = 0; b < batch.items.size(); ++b) {
    const kvcache::PagedItem& item = batch.items[b];
    if (item.*at != batch.items[0].*at ||
        static_cast<const char*>(item.*rows) != base + int64_t(cu_q[b]) * row_bytes) {
      return nullptr;
    }
  }
  return batch.items[0].*rows;
}

}  // namespace

// Byte offsets of one launch's sections, the same in the pinned host and the device scratch:
// inputs [block table, seqlens_k, cu_seqlens_q, copy ranges, q] (one H2D copy, which stops before
// q when no query is in pageable memory), outputs [o, lse] (one D2H copy), then the split-KV
// workspace (device only). The copy ranges: first one per item whose q the device addresses
// (into the packed q), then one per such O and one per head of such an LSE (out of the packed
// outputs). Queries or outputs that already lie packed in memory the device addresses (a packed
// DecodeStep's region) are read or written there by the kernel: no range, no copy.
struct CudaKvStore::Packed {
  int batch = 0;
  int total_q = 0, max_rows_q = 0;
  int64_t max_pages = 1, max_length = 0;
  std::vector<int32_t> cu_q;  // [batch + 1]
  int q_ranges = 0, out_ranges = 0;
  bool host_outputs = false;  // some O or LSE goes to pageable memory: the D2H copy is needed
  const void* q_in_place = nullptr;  // the packed queries where the items hold them, or null
  void* out_in_place = nullptr;      // the packed outputs where the items want them, or null
  int64_t table = 0, seqlens = 0, cu = 0, ranges = 0, q = 0, inputs_end = 0;
  int64_t copy_end = 0;  // the inputs the host fills: up to q's end only when some q is pageable
  int64_t o = 0, lse = 0, outputs_end = 0;
  int64_t workspace = 0, workspace_bytes = 0;
  int64_t q_row_bytes = 0;  // heads_q * head_dim * element size
};

void CudaKvStore::FillHost(const kvcache::PagedBatch& batch, const Packed& pk, char* host,
                           const char* device, char* scratch) {
  auto* table = reinterpret_cast<int32_t*>(host + pk.table);
  auto* seqlens = reinterpret_cast<int32_t*>(host + pk.seqlens);
  std::memcpy(host + pk.cu, pk.cu_q.data(), pk.cu_q.size() * sizeof(int32_t));
  for (int b = 0; b < pk.batch; ++b) {
    const kvcache::PagedItem& item = batch.items[size_t(b)];
    if (!Addressable(item.q_at)) {  // else gathered on the device (FillRanges)
      std::memcpy(host + pk.q + int64_t(pk.cu_q[size_t(b)]) * pk.q_row_bytes, item.q,
                  size_t(item.rows_q * pk.q_row_bytes));
    }
    int32_t* row = table + int64_t(b) * pk.max_pages;
    std::copy(item.pages.begin(), item.pages.end(), row);
    std::fill(row + item.pages.size(), row + pk.max_pages, 0);  // past the length: never read
    seqlens[b] = int32_t(item.length);
  }
  FillRanges(batch, pk, host, device, scratch);
}

void CudaKvStore::FillRanges(const kvcache::PagedBatch& batch, const Packed& pk, char* host,
                             const char* device, char* scratch) {
  auto* range = reinterpret_cast<KvScatterRange*>(host + pk.ranges);
  const int heads = batch.shape.heads_q;
  for (int b = 0; b < pk.batch && pk.q_in_place == nullptr; ++b) {  // queries first ...
    const kvcache::PagedItem& item = batch.items[size_t(b)];
    if (!Addressable(item.q_at)) continue;
    char* dst = const_cast<char*>(device) + pk.q + int64_t(pk.cu_q[size_t(b)]) * pk.q_row_bytes;
    *range++ = {dst, static_cast<const char*>(item.q), item.rows_q * pk.q_row_bytes};
  }
  for (int b = 0; b < pk.batch; ++b) {  // ... then outputs
    const kvcache::PagedItem& item = batch.items[size_t(b)];
    const int32_t row0 = pk.cu_q[size_t(b)];
    if (Addressable(item.out_at) && pk.out_in_place == nullptr) {
      *range++ = {static_cast<char*>(item.out), scratch + pk.o + int64_t(row0) * pk.q_row_bytes,
                  item.rows_q * pk.q_row_bytes};
    }
    if (item.lse == nullptr || !Addressable(item.lse_at)) continue;
    // Varlen LSE is [heads_q, total_q]; the item's is [heads_q, rows_q]: one range per head.
    for (int h = 0; h < heads; ++h) {
      const int64_t from = (int64_t(h) * pk.total_q + row0) * 4;
      *range++ = {reinterpret_cast<char*>(item.lse + int64_t(h) * item.rows_q),
                  scratch + pk.lse + from, int64_t(item.rows_q) * 4};
    }
  }
}

CudaKvStore::Packed CudaKvStore::Plan(const kvcache::PagedBatch& batch) const {
  const kvcache::SequenceShape& s = batch.shape;
  Packed pk;
  pk.batch = int(batch.items.size());
  pk.q_row_bytes = int64_t(s.heads_q) * s.head_dim * int64_t(kernels::dtype_size(s.dtype));
  pk.cu_q.reserve(batch.items.size() + 1);
  pk.cu_q.push_back(0);
  bool host_q = false;  // some q in pageable memory: the host packs it and the copy carries it
  for (const kvcache::PagedItem& item : batch.items) {
    pk.cu_q.push_back(pk.cu_q.back() + item.rows_q);
    pk.max_rows_q = std::max(pk.max_rows_q, item.rows_q);
    pk.max_pages = std::max<int64_t>(pk.max_pages, int64_t(item.pages.size()));
    pk.max_length = std::max(pk.max_length, item.length);
    pk.q_ranges += Addressable(item.q_at) ? 1 : 0;
    host_q |= !Addressable(item.q_at);
    const bool out_here = Addressable(item.out_at);
    const bool lse_here = item.lse != nullptr && Addressable(item.lse_at);
    pk.out_ranges += (out_here ? 1 : 0) + (lse_here ? s.heads_q : 0);
    pk.host_outputs |= !out_here || (item.lse != nullptr && !lse_here);
  }
  pk.total_q = pk.cu_q.back();
  using kvcache::PagedItem;
  const PagedItem& first = batch.items[0];
  pk.q_in_place = PackedInPlace(batch, pk.cu_q, pk.q_row_bytes, &PagedItem::q, &PagedItem::q_at,
                                Addressable(first.q_at));
  pk.out_in_place = PackedInPlace(batch, pk.cu_q, pk.q_row_bytes, &PagedItem::out,
                                  &PagedItem::out_at, Addressable(first.out_at));
  if (pk.q_in_place != nullptr) pk.q_ranges = 0;
  if (pk.out_in_place != nullptr) pk.out_ranges -= pk.batch;  // the LSE ranges stay
  pk.table = 0;
  pk.seqlens = Align(pk.table + pk.batch * pk.max_pages * 4);
  pk.cu = Align(pk.seqlens + pk.batch * 4);
  pk.ranges = Align(pk.cu + (pk.batch + 1) * 4);
  const int64_t ranges = pk.q_ranges + pk.out_ranges;
  const int64_t ranges_end = pk.ranges + ranges * int64_t(sizeof(KvScatterRange));
  pk.q = Align(ranges_end);
  pk.inputs_end = pk.q + (pk.q_in_place != nullptr ? 0 : pk.total_q * pk.q_row_bytes);
  // Gathered queries land in the q section on the device: the copy need not carry it.
  pk.copy_end = host_q ? pk.inputs_end : ranges_end;
  pk.o = Align(pk.inputs_end);
  pk.lse = Align(pk.o + pk.total_q * pk.q_row_bytes);
  pk.outputs_end = pk.lse + int64_t(s.heads_q) * pk.total_q * 4;
  pk.workspace = Align(pk.outputs_end);
  return pk;
}

absl::Status CudaKvStore::Attend(const kvcache::PagedBatch& batch, kvcache::AttendInfo* info) {
  const Packed pk = Plan(batch);
  LaunchSlot& slot = *slots_[size_t(next_slot_.fetch_add(1) % slots_.size())];
  std::lock_guard<FifoMutex> lock(slot.mu);
  cudaSetDevice(device_);
  kernels::cuda::DecodeParams p;
  if (absl::Status st = Prepare(batch, pk, &slot, &p); !st.ok()) {
    // Staged ranges may read a client's region: they must land while its lease is held.
    std::lock_guard<std::mutex> write_lock(write_mu_);
    if (absl::Status settled = SettleLocked(); !settled.ok()) return settled;
    return st;
  }
  if (absl::Status st = Enqueue(batch, pk, slot, &p); !st.ok()) {
    cudaStreamSynchronize(stream_);  // what was queued may still read the slot's scratch
    cudaGetLastError();
    return st;
  }
  // This launch's end only (the stream may hold another slot's launch behind it by now); outside
  // write_mu_: other steps stage their rows, and the next launch is queued, while this one runs.
  if (const cudaError_t e = cudaEventSynchronize(slot.events[3]); e != cudaSuccess) {
    return on_error_(e, "KV decode launch");
  }
  Scatter(batch, pk, slot);
  ReadTimes(slot, info);
  info->kernel = "decode_paged_splitkv";
  info->q_in_place = pk.q_in_place != nullptr;
  info->out_in_place = pk.out_in_place != nullptr;
  return absl::OkStatus();
}

absl::Status CudaKvStore::Prepare(const kvcache::PagedBatch& batch, const Packed& pk,
                                  LaunchSlot* slot, void* params) {
  const kvcache::SequenceShape& s = batch.shape;
  const int64_t elem = int64_t(kernels::dtype_size(s.dtype));
  kernels::cuda::DecodeParams& p = *static_cast<kernels::cuda::DecodeParams*>(params);
  p.dtype = s.dtype;
  p.batch = pk.batch;
  p.seqlen_q = pk.max_rows_q;
  p.total_q = pk.total_q;
  p.seqlen_k = int(std::max<int64_t>(pk.max_length, 1));
  p.heads_q = s.heads_q;
  p.heads_kv = s.heads_kv;
  p.head_dim = s.head_dim;
  p.softmax_scale = batch.softmax_scale;
  p.causal = batch.causal;
  p.q_row_stride = p.o_row_stride = int64_t(s.heads_q) * s.head_dim;
  p.q_head_stride = p.o_head_stride = s.head_dim;
  p.q_batch_stride = p.o_batch_stride = p.q_row_stride * pk.max_rows_q;  // unused (varlen)
  p.k_batch_stride = p.v_batch_stride = batch.format.page_bytes / elem;  // the page stride
  p.k_row_stride = p.v_row_stride = int64_t(s.heads_kv) * s.head_dim;
  p.k_head_stride = p.v_head_stride = s.head_dim;
  p.k = pool_;
  p.v = pool_ + batch.format.v_offset;
  p.page_size = batch.format.page_tokens;
  p.block_table_stride = pk.max_pages;
  // Paged and packed as launched: the split plan, the tuner's class and the workspace's rows
  // depend on it (dense, they planned another kernel and sized batch x max rows). The real
  // addresses once the scratch is reserved.
  static const int32_t kPlaceholder = 0;
  p.block_table = p.seqlens_k = p.cu_seqlens_q = &kPlaceholder;
  p.num_splits = choose_splits_(p);
  const int64_t workspace = int64_t(kernels::cuda::decode_workspace_bytes(p, p.num_splits));
  if (absl::Status st =
          Reserve(true, pk.workspace + workspace, &slot->device_scratch, &slot->device_bytes);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = Reserve(false, pk.outputs_end, &slot->host_scratch, &slot->host_bytes);
      !st.ok()) {
    return st;
  }
  char* dev = static_cast<char*>(slot->device_scratch);
  p.o = pk.out_in_place != nullptr ? pk.out_in_place : dev + pk.o;
  p.lse = reinterpret_cast<float*>(dev + pk.lse);
  p.workspace = workspace > 0 ? dev + pk.workspace : nullptr;
  p.workspace_bytes = size_t(workspace);
  p.q = dev;  // checked here; Enqueue points the inputs at where they land
  p.block_table = reinterpret_cast<const int32_t*>(dev + pk.table);
  p.seqlens_k = reinterpret_cast<const int32_t*>(dev + pk.seqlens);
  p.cu_seqlens_q = reinterpret_cast<const int32_t*>(dev + pk.cu);
  if (std::string why = kernels::cuda::decode_supported(p); !why.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the decode kernel cannot run this: ", why));
  }
  return absl::OkStatus();
}

absl::Status CudaKvStore::Enqueue(const kvcache::PagedBatch& batch, const Packed& pk,
                                  const LaunchSlot& slot, void* params) {
  kernels::cuda::DecodeParams& p = *static_cast<kernels::cuda::DecodeParams*>(params);
  char* host = static_cast<char*>(slot.host_scratch);
  char* scratch = static_cast<char*>(slot.device_scratch);
  // Under write_mu_ until the kernel is queued: a later flush overwrites the device stage, and
  // the stream keeps it behind this kernel only if it is queued after it.
  std::lock_guard<std::mutex> write_lock(write_mu_);
  if (!broken_.ok()) return broken_;
  const int64_t at = InputsAtLocked(pk.inputs_end);
  const char* inputs = at >= 0 ? stage_device_ + at : scratch;
  // events[0] after the host packing: h2d_us is device time, not this thread's memcpy.
  FillHost(batch, pk, at >= 0 ? stage_host_[stage_index_] + at : host, inputs, scratch);
  cudaError_t e = cudaEventRecord(slot.events[0], stream_);
  if (e != cudaSuccess && staged_ranges_ > 0) {
    return BreakLocked(e, "KV decode launch");  // the rows staged for it were not flushed
  }
  if (e == cudaSuccess && at >= 0) {  // rows, ranges and inputs in one copy
    if (absl::Status st = FlushLocked(pk.copy_end); !st.ok()) return st;
  } else if (e == cudaSuccess) {  // too large for the stage: the rows, then the inputs
    if (absl::Status st = FlushLocked(); !st.ok()) return st;
    e = cudaMemcpyAsync(scratch, host, size_t(pk.copy_end), cudaMemcpyHostToDevice, stream_);
  }
  const auto* ranges = reinterpret_cast<const KvScatterRange*>(inputs + pk.ranges);
  if (e == cudaSuccess) e = LaunchKvScatter(ranges, pk.q_ranges, stream_);  // q in place
  p.q = pk.q_in_place != nullptr ? pk.q_in_place : inputs + pk.q;
  p.block_table = reinterpret_cast<const int32_t*>(inputs + pk.table);
  p.seqlens_k = reinterpret_cast<const int32_t*>(inputs + pk.seqlens);
  p.cu_seqlens_q = reinterpret_cast<const int32_t*>(inputs + pk.cu);
  if (e == cudaSuccess) e = cudaEventRecord(slot.events[1], stream_);
  if (e == cudaSuccess) e = kernels::cuda::run_decode(p, stream_);
  if (e == cudaSuccess) e = cudaEventRecord(slot.events[2], stream_);
  if (e == cudaSuccess) e = LaunchKvScatter(ranges + pk.q_ranges, pk.out_ranges, stream_);
  if (e == cudaSuccess && pk.host_outputs) {
    e = cudaMemcpyAsync(host + pk.o, scratch + pk.o, size_t(pk.outputs_end - pk.o),
                        cudaMemcpyDeviceToHost, stream_);
  }
  if (e == cudaSuccess) e = cudaEventRecord(slot.events[3], stream_);
  return e == cudaSuccess ? absl::OkStatus() : on_error_(e, "KV decode launch");
}

void CudaKvStore::ReadTimes(const LaunchSlot& slot, kvcache::AttendInfo* info) {
  float ms[3] = {0.f, 0.f, 0.f};
  for (int i = 0; i < 3; ++i) {
    if (cudaEventElapsedTime(&ms[i], slot.events[i], slot.events[i + 1]) != cudaSuccess) {
      cudaGetLastError();  // not fatal: the time is then reported as 0
      ms[i] = 0.f;
    }
  }
  info->h2d_us = int64_t(ms[0] * 1000.f);
  info->kernel_us = int64_t(ms[1] * 1000.f);
  info->d2h_us = int64_t(ms[2] * 1000.f);
}

void CudaKvStore::Scatter(const kvcache::PagedBatch& batch, const Packed& pk,
                          const LaunchSlot& slot) {
  const char* host = static_cast<const char*>(slot.host_scratch);
  const auto* lse = reinterpret_cast<const float*>(host + pk.lse);
  for (int b = 0; b < pk.batch; ++b) {
    const kvcache::PagedItem& item = batch.items[size_t(b)];
    const int32_t row0 = pk.cu_q[size_t(b)];
    if (!Addressable(item.out_at)) {  // else written by the output scatter
      std::memcpy(item.out, host + pk.o + int64_t(row0) * pk.q_row_bytes,
                  size_t(item.rows_q * pk.q_row_bytes));
    }
    if (item.lse == nullptr || Addressable(item.lse_at)) continue;
    // Varlen LSE is [heads_q, total_q]; the item's is [heads_q, rows_q].
    for (int h = 0; h < batch.shape.heads_q; ++h) {
      std::memcpy(item.lse + int64_t(h) * item.rows_q, lse + int64_t(h) * pk.total_q + row0,
                  size_t(item.rows_q) * sizeof(float));
    }
  }
}

}  // namespace flashserve
