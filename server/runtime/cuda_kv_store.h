// The CUDA backend's KV store: the pool is one device allocation on the first GPU; attention is
// the paged split-KV decode kernel (kernels/cuda/decode, flashserve/kernels/decode_attention.h)
// over every item of a batch in one launch (varlen queries, one block table, per-item lengths).
//
// Writes and launches go to one stream of its own, in the order they are issued, so a launch
// sees every row written before it started (the SequenceCache issues writes under its lock).
// Small writes (a decode step's rows) become ranges of one scatter launch (runtime/kv_scatter.h)
// queued when the stage is flushed: before every launch, before a large write, or when the stage
// is full. Rows in pageable memory are first staged in pinned memory (and land by one H2D copy);
// rows the device can address (a client's CUDA region on this device, or a page-locked system
// region) are read by the scatter where they are. Large writes (prefixes) are copied directly.
// A launch holds one of `launches_in_flight` slots (scratch buffers and timing events) from its
// preparation until its answers are copied out, so with two slots the next launch is prepared and
// queued while one runs on the GPU (the one stream keeps them in order). A batch is one launch, and
// a step costs one H2D copy (staged rows, their ranges and the launch's tables, ranges and queries
// in pageable memory, together), one row scatter, one query gather (items whose q the device
// addresses), one decode launch, one output scatter (outputs the device addresses) and one D2H copy
// (only when some output is in pageable memory). Queries and outputs that lie packed in item order
// in memory the device addresses (a packed DecodeStep's CUDA region, or its page-locked system
// region) need neither gather nor scatter: the kernel reads and writes them there.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "common/fifo_mutex.h"
#include "flashserve/kernels/decode_attention.h"
#include "kvcache/kv_store.h"

namespace flashserve {

/// Thread-safe.
class CudaKvStore final : public kvcache::KvStore {
 public:
  /// The backend's handling of a CUDA error (marks it unhealthy when the error is sticky);
  /// returns the status to answer with.
  using ErrorHandler = std::function<absl::Status(cudaError_t, const char*)>;
  /// The split-KV count for a launch (the autotuner's, or the heuristic's: DecodeSplitsFor).
  using SplitChooser = std::function<int(const kernels::cuda::DecodeParams&)>;
  /// RESOURCE_EXHAUSTED when `bytes` of device memory cannot be had on `device`.
  /// `launches_in_flight` (>= 1): launches that may be queued on the GPU at once.
  static absl::StatusOr<std::unique_ptr<CudaKvStore>> Create(int64_t bytes, int device,
                                                             int launches_in_flight,
                                                             SplitChooser choose_splits,
                                                             ErrorHandler on_error);
  ~CudaKvStore() override;

  std::string_view kind() const override { return "cuda"; }
  int64_t capacity_bytes() const override { return bytes_; }
  absl::Status Write(int64_t offset, const void* src, int64_t bytes, kvcache::BytesAt at) override;
  /// Waits (without the write lock) for the direct copies from page-locked kHost sources that the
  /// calling thread queued; at once when it queued none.
  absl::Status AwaitSources() override;
  /// Flushes the staged writes: one scatter launch applies its ranges in no particular order,
  /// so a freed page's old rows and its next owner's must not share one.
  void Fence() override;
  /// Flushes the staged writes and waits for the stream.
  absl::Status Settle() override;
  absl::Status Attend(const kvcache::PagedBatch& batch, kvcache::AttendInfo* info) override;
  std::vector<int> head_dims() const override;
  int device() const override { return device_; }
  /// Whether the device reads and writes `at` memory where it is (else the store copies it).
  bool Addressable(kvcache::BytesAt at) const;
  /// Tests: the stream writes and launches go to (to queue device work ahead of a write).
  cudaStream_t stream_for_testing() const { return stream_; }
  /// Called once when staged rows are lost to a failed CUDA call (the store then refuses every
  /// call: sequences the cache says exist lack rows). The backend reports itself unhealthy, so
  /// that the process is replaced and clients re-create their sequences elsewhere.
  void set_on_broken(std::function<void(const absl::Status&)> on_broken);
  /// Tests: the next flush fails as a refused copy would (nothing of it queued).
  void FailNextFlushForTesting();

 private:
  // Host-side tables and packed queries of one launch (CudaKvStore::Pack).
  struct Packed;
  // One launch's scratch and timing events, held from Prepare until its answers are copied out.
  struct LaunchSlot {
    FifoMutex mu;  // callers of one slot take turns in the order they came
    void* device_scratch = nullptr;
    int64_t device_bytes = 0;
    void* host_scratch = nullptr;  // pinned
    int64_t host_bytes = 0;
    // Before the flush, before the kernel, after it, after the D2H copy.
    cudaEvent_t events[4] = {nullptr, nullptr, nullptr, nullptr};
  };
  CudaKvStore(int64_t bytes, int device, SplitChooser choose_splits, ErrorHandler on_error)
      : bytes_(bytes),
        device_(device),
        id_(NewId()),
        choose_splits_(std::move(choose_splits)),
        on_error_(std::move(on_error)) {}
  static uint64_t NewId();  // distinct for every store of the process
  // Sections of the stage and the launch scratch start 256-byte aligned.
  static constexpr int64_t Align(int64_t bytes) { return (bytes + 255) / 256 * 256; }
  // Sizes and offsets of one launch's sections.
  Packed Plan(const kvcache::PagedBatch& batch) const;
  // Grows `*buffer` (device or pinned host) to at least `bytes`.
  absl::Status Reserve(bool device, int64_t bytes, void** buffer, int64_t* capacity);
  // Queues the staged writes (data, ranges and `extra` bytes already placed after them, in one
  // copy; then the scatter) and switches to the other stage buffer.
  absl::Status FlushLocked(int64_t extra = 0);
  // Where the launch inputs go in the stage buffer (after the data and ranges), or -1 when
  // `bytes` of them do not fit there.
  int64_t InputsAtLocked(int64_t bytes) const;
  // Fills `host` with the packed queries (those in pageable memory), tables and copy ranges;
  // `device` is where `host` will land on the device; `scratch` the launch's device scratch.
  void FillHost(const kvcache::PagedBatch& batch, const Packed& packed, char* host,
                const char* device, char* scratch);
  // The copy ranges of one launch: queries into the packed inputs, outputs to their places.
  void FillRanges(const kvcache::PagedBatch& batch, const Packed& packed, char* host,
                  const char* device, char* scratch);
  // A flush failed with rows staged: they are dropped (their sources may be freed once the
  // calls return) and the store refuses everything from now on. Returns the refusal.
  absl::Status BreakLocked(cudaError_t e, const char* what);
  // Settle under write_mu_: flush, then wait for everything queued on the stream.
  absl::Status SettleLocked();
  // Stages one range (the caller copied its bytes to the stage when they come from it).
  absl::Status AddRangeLocked(char* dst, const char* src, int64_t bytes);
  // Reserves the slot's scratch and fills in the decode parameters (inputs' pointers left unset).
  absl::Status Prepare(const kvcache::PagedBatch& batch, const Packed& packed, LaunchSlot* slot,
                       void* params);
  // Queues rows, inputs, the decode kernel and the output copy (timed by the slot's events).
  absl::Status Enqueue(const kvcache::PagedBatch& batch, const Packed& packed,
                       const LaunchSlot& slot, void* params);
  // Copies each item's O and LSE out of the slot's pinned scratch.
  void Scatter(const kvcache::PagedBatch& batch, const Packed& packed, const LaunchSlot& slot);
  // The device times between the slot's events (after they completed).
  static void ReadTimes(const LaunchSlot& slot, kvcache::AttendInfo* info);

  const int64_t bytes_;
  const int device_;
  const uint64_t id_;  // tells this store's copies apart in a thread's queued sources
  const SplitChooser choose_splits_;
  const ErrorHandler on_error_;
  bool host_addressable_ = false;  // page-locked host memory: its host pointer works on device_
  char* pool_ = nullptr;
  cudaStream_t stream_ = nullptr;
  // Launches take the slots in turn: launch n waits only for launch n - slots to be answered.
  std::vector<std::unique_ptr<LaunchSlot>> slots_;
  std::atomic<uint64_t> next_slot_{0};

  // The write stage: two pinned buffers used in turn, one device copy of them. A flush lays out
  // [data][ranges][launch inputs] so that one copy moves all of it.
  static constexpr int kMaxRanges = 8192;
  static constexpr int64_t kRangeBytes = int64_t(kMaxRanges) * 24;  // sizeof(KvScatterRange)
  static constexpr int64_t kStageDataBytes = int64_t(4) << 20;
  static constexpr int64_t kStageInputBytes = int64_t(8) << 20;  // launch inputs that fit
  static constexpr int64_t kStageBytes = kStageDataBytes + kRangeBytes + 512 + kStageInputBytes;
  static constexpr int64_t kDirectWriteBytes = int64_t(64) << 10;  // and larger: no staging
  std::mutex write_mu_;  // guards the stage; taken after a slot's mu, never before
  absl::Status broken_;  // not OK once staged rows were lost (BreakLocked)
  std::function<void(const absl::Status&)> on_broken_;
  bool fail_next_flush_ = false;
  char* stage_host_[2] = {nullptr, nullptr};
  cudaEvent_t stage_done_[2] = {nullptr, nullptr};  // after the last flush that read each buffer
  // Direct copies from page-locked kHost sources queued (their tickets), and the ticket up to which
  // AwaitSources saw them read.
  int64_t sources_queued_ = 0, sources_read_ = 0;
  char* stage_device_ = nullptr;
  int stage_index_ = 0;
  std::vector<char> staged_ranges_host_;  // KvScatterRange[kMaxRanges], copied at the flush
  int staged_ranges_ = 0;
  int64_t staged_bytes_ = 0;
};

}  // namespace flashserve
