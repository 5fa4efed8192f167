#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_kv_store.h"
#include "runtime/kv_scatter.h"

// Rows written into the KV pool: staged in pinned buffers and applied by one scatter launch per
// flush, or copied directly when large; a failed flush breaks the store for good.

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

}  // namespace

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

absl::Status CudaKvStore::Settle() {
  std::lock_guard<std::mutex> lock(write_mu_);
  return SettleLocked();
}

absl::Status CudaKvStore::SettleLocked() {
  cudaSetDevice(device_);
  if (absl::Status flushed = FlushLocked(); !flushed.ok()) return flushed;  // broken: synced
  if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
    return on_error_(e, "KV cache write flush");
  }
  return absl::OkStatus();
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
  const int64_t bytes =
      extra > 0 ? Align(ranges_at + ranges_bytes) + extra : ranges_at + ranges_bytes;
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

}  // namespace flashserve
