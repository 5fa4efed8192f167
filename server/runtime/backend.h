// The compute backend interface: CPU (thread pool) or CUDA (GPU kernels).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/attention_problem.h"

namespace flashserve {

class PinnedPool;

struct DeviceDescription {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int64_t total_memory_bytes = 0;
};

struct BackendCapabilities {
  std::string name;  // "cpu" or "cuda"
  std::vector<kernels::DType> dtypes;
  std::vector<int> head_dims;  // exact list; empty means any in [1, max_head_dim]
  int max_head_dim = 0;
  std::vector<DeviceDescription> devices;
};

/// Microseconds spent in each phase of one job (0 where a phase does not apply).
struct PhaseTiming {
  int64_t stage_us = 0;  // host copy of the inputs into staging memory (CPU time, not overlapped)
  int64_t h2d_us = 0;
  int64_t compute_us = 0;
  int64_t d2h_us = 0;
};

/// Where a tensor's bytes are: spans of the memory they arrived in, in order.
using InputPieces = std::vector<std::string_view>;

/// Where a job's results go (host memory owned by the call) and how to run it.
struct JobOutput {
  void* out = nullptr;   // out_bytes() bytes, dtype of the problem
  float* lse = nullptr;  // lse_elements() floats, or nullptr
  // The problem's inputs and out/lse are page-locked (IoBuffers from the backend's pinned pool):
  // the GPU copies straight from and to them, no staging copy.
  bool pinned = false;
  // out and lse lie in one buffer laid out like the device's (IoBuffers): one D2H copy serves both.
  bool outputs_in_one_buffer = false;
  // Non-null (all three): q, k and v are these pieces of page-locked memory (the receive arena),
  // which the backend copies to the device in place; problem.q/k/v are then unused. Only given
  // when ReadsInPlace said yes.
  const InputPieces* input_pieces[3] = {nullptr, nullptr, nullptr};
  // A job still waiting for a device when this passes is answered DEADLINE_EXCEEDED, not run.
  absl::Time deadline = absl::InfiniteFuture();
  // Test hook (--enable_fault_injection only): fault the device instead of computing.
  bool inject_device_fault = false;
};

/// What a finished job reports.
struct JobResult {
  absl::Status status;
  PhaseTiming timing;
  std::string kernel;  // the name of what ran (empty on failure)
};
using JobDone = std::function<void(JobResult)>;

/// Thread-safe: Run/RunAsync are called concurrently from the scheduler's workers.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const BackendCapabilities& capabilities() const = 0;
  /// Computes the problem synchronously into `output`. `kernel` receives the name of
  /// what ran. RESOURCE_EXHAUSTED when memory for it cannot be had; INTERNAL on a device fault.
  virtual absl::Status Run(const AttentionProblem& problem, const JobOutput& output,
                           PhaseTiming* timing, std::string* kernel) = 0;
  /// Starts the problem and returns; `done` is called exactly once when `output` holds the result
  /// (or with the error), possibly inline, possibly on another thread. The problem's input bytes and
  /// `output` must stay valid until then. The default runs Run() inline (the CPU backend: its
  /// thread pool is the parallelism); the CUDA backend returns once the work is queued on a stream.
  virtual void RunAsync(const AttentionProblem& problem, const JobOutput& output, JobDone done) {
    JobResult result;
    result.status = Run(problem, output, &result.timing, &result.kernel);
    done(std::move(result));
  }
  /// True when RunAsync would start a job now without waiting (it only queues work on a device
  /// with a free stream): the runtime then launches on the caller's thread instead of handing the
  /// job to a scheduler worker. The default (CPU: RunAsync computes) is false. Thread-safe; a hint.
  virtual bool can_launch_now() { return false; }
  /// False after a fault that makes the backend unusable (a sticky CUDA error).
  virtual bool healthy() const { return true; }
  /// Bytes in use and reserved by the device memory pool of `device`; false when the backend
  /// has no such pool. Thread-safe (called from the metrics scrape).
  virtual bool DevicePoolBytes(int device, int64_t* used, int64_t* reserved) const {
    return false;
  }
  /// Bytes in use and reserved by the pinned host staging pool; false when there is none.
  /// Thread-safe (called from the metrics scrape).
  virtual bool PinnedPoolBytes(int64_t* used, int64_t* reserved) const { return false; }
  /// Where request buffers (IoBuffers) should come from: the pinned staging pool, or nullptr for
  /// heap memory. Thread-safe.
  virtual PinnedPool* staging_pool() { return nullptr; }
  /// True when the backend can copy tensors lying in these pieces to the device without a host
  /// copy (CUDA: every piece is inside the page-locked receive arena). Thread-safe.
  virtual bool ReadsInPlace(const InputPieces* const pieces[3]) const { return false; }
};

}  // namespace flashserve
