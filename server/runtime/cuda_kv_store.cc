#include "runtime/cuda_kv_store.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "flashserve/kernels/decode_attention.h"
#include "runtime/kv_scatter.h"

namespace flashserve {

namespace {

// Per thread, the last direct copy from a page-locked kHost source it queued on each store (by
// store id): AwaitSources waits for the calling thread's own copies only -- a step's preparation,
// which writes under the cache's lock, must not wait for an append's copies on another thread.
struct QueuedSource {
  uint64_t store = 0;
  int64_t ticket = 0;
};
thread_local std::vector<QueuedSource> queued_sources;
std::atomic<uint64_t> next_store_id{1};

void RememberSource(uint64_t store, int64_t ticket) {
  for (QueuedSource& q : queued_sources) {
    if (q.store == store) {
      q.ticket = ticket;
      return;
    }
  }
  queued_sources.push_back({store, ticket});
}

// The calling thread's last ticket on `store` (forgotten here), or 0.
int64_t TakeSource(uint64_t store) {
  for (size_t i = 0; i < queued_sources.size(); ++i) {
    if (queued_sources[i].store != store) continue;
    const int64_t ticket = queued_sources[i].ticket;
    queued_sources.erase(queued_sources.begin() + long(i));
    return ticket;
  }
  return 0;
}

// Whether `p` is page-locked host memory (allocated or registered with CUDA): a copy from it runs
// asynchronously. When CUDA cannot tell, yes (the caller then waits, which is always safe).
bool PageLocked(const void* p) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return attributes.type == cudaMemoryTypeHost;
}

int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }

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

absl::StatusOr<std::unique_ptr<CudaKvStore>> CudaKvStore::Create(int64_t bytes, int device,
                                                                 int launches_in_flight,
                                                                 SplitChooser choose_splits,
                                                                 ErrorHandler on_error) {
  if (launches_in_flight < 1) {
    return absl::InvalidArgumentError("the KV store needs at least one launch in flight");
  }
  auto store = std::unique_ptr<CudaKvStore>(
      new CudaKvStore(bytes, device, std::move(choose_splits), std::move(on_error)));
  cudaSetDevice(device);
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&store->pool_), size_t(bytes));
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes,
                                                     " bytes of device memory for the KV cache "
                                                     "(--kv_cache_bytes): ",
                                                     cudaGetErrorString(e)));
  }
  if ((e = cudaStreamCreateWithFlags(&store->stream_, cudaStreamNonBlocking)) != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("CUDA stream: ", cudaGetErrorString(e)));
  }
  static_assert(sizeof(KvScatterRange) == 24, "kRangeBytes assumes 24-byte ranges");
  int can_use_host_pointer = 0;
  if (cudaDeviceGetAttribute(&can_use_host_pointer,
                             cudaDevAttrCanUseHostPointerForRegisteredMem,
                             device) != cudaSuccess) {
    cudaGetLastError();
  }
  store->host_addressable_ = can_use_host_pointer != 0;
  const size_t stage = size_t(kStageBytes);
  store->staged_ranges_host_.resize(size_t(kRangeBytes));
  e = cudaMalloc(reinterpret_cast<void**>(&store->stage_device_), stage);
  for (int s = 0; s < launches_in_flight && e == cudaSuccess; ++s) {
    store->slots_.push_back(std::make_unique<LaunchSlot>());
    for (cudaEvent_t& event : store->slots_.back()->events) {
      if (e == cudaSuccess) e = cudaEventCreate(&event);
    }
  }
  for (int i = 0; i < 2 && e == cudaSuccess; ++i) {
    e = cudaHostAlloc(reinterpret_cast<void**>(&store->stage_host_[i]), stage,
                      cudaHostAllocDefault);
    if (e == cudaSuccess) {
      e = cudaEventCreateWithFlags(&store->stage_done_[i], cudaEventDisableTiming);
    }
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache write stage: ", cudaGetErrorString(e)));
  }
  return store;
}

CudaKvStore::~CudaKvStore() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  cudaFree(pool_);
  for (const std::unique_ptr<LaunchSlot>& slot : slots_) {
    cudaFree(slot->device_scratch);
    cudaFreeHost(slot->host_scratch);
    for (cudaEvent_t event : slot->events) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }
  cudaFree(stage_device_);
  for (int i = 0; i < 2; ++i) {
    cudaFreeHost(stage_host_[i]);
    if (stage_done_[i] != nullptr) cudaEventDestroy(stage_done_[i]);
  }
}

std::vector<int> CudaKvStore::head_dims() const { return kernels::cuda::decode_head_dims(); }

bool CudaKvStore::Addressable(kvcache::BytesAt at) const {
  return at == kvcache::BytesAt::kDevice ||
         (at == kvcache::BytesAt::kPageLocked && host_addressable_);
}

absl::Status CudaKvStore::Write(int64_t offset, const void* src, int64_t bytes,
                                kvcache::BytesAt at) {
  if (offset < 0 || bytes < 0 || offset + bytes > bytes_) {
    return absl::InternalError("KV store write outside the pool");
  }
  std::lock_guard<std::mutex> lock(write_mu_);
  if (!broken_.ok()) return broken_;
  const bool in_place = Addressable(at);
  if (bytes >= kDirectWriteBytes) {
    cudaSetDevice(device_);  // a staged write (below) makes no CUDA call until its flush
    // After what is staged (the stream keeps the writes in order). From pageable memory the
    // driver stages the bytes before returning, so `src` may be reused; from page-locked memory
    // the copy reads `src` when the stream reaches it, behind the launches in flight. A kHost
    // source there (a message string the server's malloc took from the page-locked receive
    // arena) is freed by the caller once AwaitSources returns: counted for it.
    if (absl::Status s = FlushLocked(); !s.ok()) return s;
    const cudaError_t e =
        cudaMemcpyAsync(pool_ + offset, src, size_t(bytes), cudaMemcpyDefault, stream_);
    if (e != cudaSuccess) return on_error_(e, "KV cache write");
    if (at == kvcache::BytesAt::kHost && PageLocked(src)) RememberSource(id_, ++sources_queued_);
    return absl::OkStatus();
  }
  if (in_place) return AddRangeLocked(pool_ + offset, static_cast<const char*>(src), bytes);
  const int64_t padded = (bytes + 15) / 16 * 16;  // keeps every staged range 16-byte aligned
  if (staged_ranges_ == kMaxRanges || staged_bytes_ + padded > kStageDataBytes) {
    cudaSetDevice(device_);  // before the copy: a flush below would not carry these bytes
    if (absl::Status s = FlushLocked(); !s.ok()) return s;
  }
  std::memcpy(stage_host_[stage_index_] + staged_bytes_, src, size_t(bytes));
  const int64_t at_stage = staged_bytes_;
  staged_bytes_ += padded;
  return AddRangeLocked(pool_ + offset, stage_device_ + at_stage, bytes);
}

uint64_t CudaKvStore::NewId() { return next_store_id.fetch_add(1); }

absl::Status CudaKvStore::AwaitSources() {
  const int64_t mine = TakeSource(id_);
  if (mine == 0) return absl::OkStatus();
  std::unique_lock<std::mutex> lock(write_mu_);
  if (sources_read_ >= mine) return absl::OkStatus();
  const int64_t queued = sources_queued_;
  cudaSetDevice(device_);
  cudaEvent_t read = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&read, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(read, stream_);
  lock.unlock();  // launches and writes queue on behind the copies meanwhile
  if (e == cudaSuccess) e = cudaEventSynchronize(read);
  if (read != nullptr) cudaEventDestroy(read);
  if (e != cudaSuccess) return on_error_(e, "KV cache write");
  lock.lock();
  sources_read_ = std::max(sources_read_, queued);
  return absl::OkStatus();
}

absl::Status CudaKvStore::AddRangeLocked(char* dst, const char* src, int64_t bytes) {
  if (staged_ranges_ == kMaxRanges) {  // only for in-place ranges (Write checked staged ones)
    cudaSetDevice(device_);
    if (absl::Status s = FlushLocked(); !s.ok()) return s;
  }
  const KvScatterRange range{dst, src, bytes};
  std::memcpy(staged_ranges_host_.data() + int64_t(staged_ranges_++) * 24, &range, 24);
  return absl::OkStatus();
}

void CudaKvStore::Fence() {
  std::lock_guard<std::mutex> lock(write_mu_);
  cudaSetDevice(device_);
  FlushLocked().IgnoreError();  // a failure was reported to the backend (on_error_)
}

int64_t CudaKvStore::InputsAtLocked(int64_t bytes) const {
  const int64_t at = Align(staged_bytes_ + int64_t(staged_ranges_) * 24);
  return at + bytes <= kStageBytes ? at : -1;
}

absl::Status CudaKvStore::FlushLocked(int64_t extra) {
  if (!broken_.ok()) return broken_;
  if (staged_ranges_ == 0 && extra == 0) return absl::OkStatus();
  char* host = stage_host_[stage_index_];
  const int64_t ranges_at = staged_bytes_;  // 16-byte aligned (every range is padded)
  const int64_t ranges_bytes = int64_t(staged_ranges_) * 24;
  std::memcpy(host + ranges_at, staged_ranges_host_.data(), size_t(ranges_bytes));
  const int64_t bytes = extra > 0 ? Align(ranges_at + ranges_bytes) + extra
                                  : ranges_at + ranges_bytes;
  cudaError_t e =
      std::exchange(fail_next_flush_, false)
          ? cudaErrorInvalidValue
          : cudaMemcpyAsync(stage_device_, host, size_t(bytes), cudaMemcpyHostToDevice, stream_);
  if (e == cudaSuccess) {
    e = LaunchKvScatter(reinterpret_cast<const KvScatterRange*>(stage_device_ + ranges_at),
                        staged_ranges_, stream_);
  }
  // Not all queued: the rows (and this buffer) are in an unknown state.
  if (e == cudaSuccess) e = cudaEventRecord(stage_done_[stage_index_], stream_);
  if (e != cudaSuccess) return BreakLocked(e, "KV cache write flush");
  stage_index_ ^= 1;
  staged_ranges_ = 0;
  staged_bytes_ = 0;
  // The other buffer is filled from now on: the copies that read it last must have finished.
  e = cudaEventSynchronize(stage_done_[stage_index_]);
  return e == cudaSuccess ? absl::OkStatus() : BreakLocked(e, "KV cache write flush");
}

absl::Status CudaKvStore::BreakLocked(cudaError_t e, const char* what) {
  const absl::Status reported = on_error_(e, what);
  cudaStreamSynchronize(stream_);  // what did get queued may still read the stage
  cudaGetLastError();
  staged_ranges_ = 0;
  staged_bytes_ = 0;
  if (broken_.ok()) {
    broken_ = absl::UnavailableError(absl::StrCat(
        "the KV cache lost rows it had accepted (", reported.message(),
        "): it refuses every call; the server reports not live, and its sequences must be "
        "created again"));
    if (on_broken_) on_broken_(broken_);
  }
  return broken_;
}

void CudaKvStore::set_on_broken(std::function<void(const absl::Status&)> on_broken) {
  std::lock_guard<std::mutex> lock(write_mu_);
  on_broken_ = std::move(on_broken);
}

void CudaKvStore::FailNextFlushForTesting() {
  std::lock_guard<std::mutex> lock(write_mu_);
  fail_next_flush_ = true;
}

absl::Status CudaKvStore::Reserve(bool device, int64_t bytes, void** buffer, int64_t* capacity) {
  if (bytes <= *capacity) return absl::OkStatus();
  const int64_t grown = std::max(bytes, *capacity * 2);
  if (device) {
    cudaFree(*buffer);
  } else {
    cudaFreeHost(*buffer);
  }
  *buffer = nullptr;
  *capacity = 0;
  const cudaError_t e = device ? cudaMalloc(buffer, size_t(grown))
                               : cudaHostAlloc(buffer, size_t(grown), cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("KV launch scratch of ", grown, " bytes: ", cudaGetErrorString(e)));
  }
  *capacity = grown;
  return absl::OkStatus();
}

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
    if (absl::Status flushed = FlushLocked(); !flushed.ok()) return flushed;
    if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return on_error_(e, "KV cache write flush");
    }
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
