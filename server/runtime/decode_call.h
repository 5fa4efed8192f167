// One decode call (a DecodeStep, or an Attend: one item, no rows) as the Sequences runtime and
// its batcher hold it until it is answered.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "kvcache/sequence_cache.h"

namespace flashserve {

/// What one finished decode call reports.
struct DecodeReport {
  int64_t prepare_us = 0;  // received -> submitted (the edge parsed, checked, built the call)
  int64_t queue_us = 0;    // submitted -> its launch started
  int64_t compute_us = 0;  // the launch (append excluded)
  int64_t append_us = 0;   // rows appended to the pool (host or device copies)
  int64_t h2d_us = 0, kernel_us = 0, d2h_us = 0;  // device times inside compute_us (CUDA)
  std::string kernel;
  int batched_calls = 1;         // calls that ran in the same launch
  std::vector<int64_t> lengths;  // per item: the layer's length after the append
  // Per item: expected_length found its rows already appended (not appended again).
  std::vector<bool> already_appended;
};

/// One DecodeStep (or Attend: one item, no rows) as the runtime runs it. The edge keeps the
/// request (items point into it) and the outputs alive until `done`.
struct DecodeCall {
  std::vector<kvcache::StepItem> items;
  bool causal = false;
  float softmax_scale = 0.f;  // > 0 (the edge resolves the default)
  std::vector<void*> out;     // per item: [rows_q, heads_q, head_dim] of q's dtype
  std::vector<float*> lse;    // per item: [heads_q, rows_q], or empty (no LSE)
  // Where out[i] / lse[i] live; shorter than out / lse (or empty): the rest are kHost.
  std::vector<kvcache::BytesAt> out_at, lse_at;
  // Some q/k/v rows are read from a client's system / CUDA shared-memory region: the call counts
  // once in request_inputs_total{path="shm_system"} / {path="shm_cuda"} for each kind it reads,
  // as an Attention call does (AttentionRuntime::Call::shm_input_path); rows in the message count
  // in no path.
  bool shm_system_inputs = false, shm_cuda_inputs = false;
  absl::Time received;
  absl::Time submitted;  // set by SequenceRuntime::Submit
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  /// Called exactly once, on some thread. On an error before the launch no row of the call was
  /// appended; a launch that failed (device fault) or was stopped (the CPU store's deadline or
  /// cancel) leaves them appended -- a retry naming expected_length is then answered without
  /// appending them again.
  std::function<void(const absl::Status&, const DecodeReport&)> done;
  /// Set by SequenceRuntime::Submit (with a TTL): the call stops counting as waiting in the cache
  /// (SequenceCache::CallLeft; its sequences may be evicted again). Runs once, however often
  /// called: when the step is prepared, and again (a no-op then) with done().
  std::function<void()> stop_waiting;
  /// The submitting thread waits for done() anyway (the local socket): without a batch window the
  /// call runs on it when a scheduler worker would be idle, instead of waking a worker.
  bool caller_waits = false;
};

/// CANCELLED or DEADLINE_EXCEEDED for a call nobody waits for any more at `now` (answered so
/// without running: none of its rows appended); OK while it is still wanted.
inline absl::Status StaleCallStatus(const DecodeCall& call, absl::Time now) {
  if (call.cancelled && call.cancelled()) {
    return absl::CancelledError("the call was cancelled before it ran");
  }
  if (now > call.deadline) {
    return absl::DeadlineExceededError("deadline passed while the call waited");
  }
  return absl::OkStatus();
}

}  // namespace flashserve
