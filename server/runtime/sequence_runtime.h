// The Sequences API's runtime: the KV cache (server/kvcache) on the backend's KvStore, and the
// decode steps that read it, queued like every other request (the scheduler's queue bounds them)
// and, with a batch window, merged across calls into one paged launch (runtime/decode_batcher.h).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/work_queue.h"
#include "kvcache/kv_metrics.h"
#include "kvcache/sequence_cache.h"
#include "metrics/server_metrics.h"
#include "runtime/backend.h"
#include "runtime/decode_call.h"
#include "runtime/job_count.h"
#include "runtime/scheduler.h"

namespace flashserve {

struct SequenceRuntimeOptions {
  kvcache::KvCacheOptions cache;   // capacity_bytes 0: the Sequences API is off
  int64_t batch_window_us = 0;     // --batch_window_us; 0: no window
  bool batch_when_busy = false;    // --batch_when_busy: calls arriving mid-launch go next, together
  int max_batch_sequences = 1024;  // --max_batch_sequences: sequences per launch (and per call)
  // --decode_launches_in_flight: decode launches queued on the GPU at once (the next one is
  // prepared while one runs); with --batch_when_busy also the batches that run at once (at most
  // the scheduler's workers).
  int launches_in_flight = 2;

  /// INVALID_ARGUMENT naming the flag.
  absl::Status Check() const;
};

class DecodeBatcher;
struct PreparedDecode;

/// Thread-safe. Borrows the backend, scheduler and metrics (may be null): they must outlive it.
class SequenceRuntime {
 public:
  /// FAILED_PRECONDITION when the backend has no KV store; RESOURCE_EXHAUSTED when its memory
  /// cannot be had.
  static absl::StatusOr<std::unique_ptr<SequenceRuntime>> Create(
      const SequenceRuntimeOptions& options, Backend* backend, Scheduler* scheduler,
      ServerMetrics* metrics);
  /// Hands on the calls still waiting for their batch (run, or answered UNAVAILABLE once the
  /// scheduler stopped accepting), then waits until every call handed to the scheduler has ended
  /// (each uses the cache and the store).
  ~SequenceRuntime();

  kvcache::SequenceCache& cache() { return *cache_; }
  const SequenceRuntimeOptions& options() const { return options_; }
  std::string_view backend_kind() const { return store_->kind(); }
  /// The KV store's CUDA device (-1: host memory): where a CUDA region's items must be.
  int store_device() const { return store_->device(); }

  /// Answers through call->done exactly once (maybe inline: RESOURCE_EXHAUSTED when the queue
  /// is full, INVALID_ARGUMENT for more than max_batch_sequences items). A call counts its
  /// shared-memory input paths (DecodeCall::shm_system_inputs / shm_cuda_inputs) once its rows
  /// are appended and it goes to its launch.
  void Submit(std::shared_ptr<DecodeCall> call);

 private:
  SequenceRuntime(const SequenceRuntimeOptions& options, Scheduler* scheduler);
  // Runs on a scheduler worker: prepares each call (drops expired/cancelled ones), merges those
  // that fit one launch, runs the launches, answers.
  void RunCalls(std::vector<std::shared_ptr<DecodeCall>> calls, bool from_batcher);
  // Drops a cancelled or expired call, else appends its rows and pins its sequences (answering
  // it on an error).
  std::optional<PreparedDecode> Prepare(std::shared_ptr<DecodeCall> call, absl::Time start);
  // With a TTL: evicts sequences idle past it every TTL/8 (at least 10 ms apart) even when no
  // call comes, so the pool's gauges and GetKvPoolInfo show what is really held (eviction also
  // runs from calls). Runs on sweeper_ until the destructor says stop.
  void SweepIdle();
  // With a TTL: the call counts as waiting in the cache (its sequences are not evicted under it)
  // until its step is prepared or it is answered (DecodeCall::stop_waiting).
  void MarkWaiting(DecodeCall* call);
  // Hands the call to the batcher, or to the scheduler without one.
  void Enqueue(std::shared_ptr<DecodeCall> call);
  // A call whose sequence an Append is copying into waits for that copy here -- on the caller's
  // own thread when it waits anyway (the local socket), else on append_waits_ -- and is enqueued
  // after it: in PrepareStep it would hold a scheduler worker (the CPU backend has one) and the
  // other calls of its batch meanwhile.
  void AwaitAppendsThenEnqueue(std::shared_ptr<DecodeCall> call);
  // from_batcher: the calls are one batch of batcher_, told BatchDone once they are answered.
  // run_inline: on this thread if a worker would be idle (Scheduler::SubmitOrRunInline).
  void Dispatch(std::vector<std::shared_ptr<DecodeCall>> calls, bool from_batcher, bool run_inline);
  // One paged launch over calls that share a shape, mask and scale; answers each of them.
  void RunLaunch(const std::vector<PreparedDecode*>& launch);

  const SequenceRuntimeOptions options_;
  Scheduler* const scheduler_;
  std::unique_ptr<kvcache::KvCacheMetrics> metrics_;
  ServerMetrics* request_metrics_ = nullptr;  // request_inputs_total; null: no metrics
  std::unique_ptr<kvcache::KvStore> store_;
  std::unique_ptr<kvcache::SequenceCache> cache_;
  std::unique_ptr<DecodeBatcher> batcher_;  // null when batch_window_us == 0
  // Runs AwaitAppendsThenEnqueue's waits (no thread of gRPC's may wait); reset first in the
  // destructor, enqueueing what still waits.
  std::unique_ptr<WorkQueue> append_waits_;
  std::mutex sweep_mu_;
  std::condition_variable sweep_stop_;
  bool sweep_stopping_ = false;  // guarded by sweep_mu_
  std::thread sweeper_;          // SweepIdle; not started without a TTL
  // Jobs handed to the scheduler and not yet ended. They use this runtime (its cache, store and
  // batcher), and the scheduler may run a queued one after its owner began destroying the
  // runtime (the server destroys the runtime first): the destructor waits for them.
  JobCount jobs_;
};

}  // namespace flashserve
