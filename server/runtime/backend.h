// The compute backend interface: CPU (thread pool) or CUDA (GPU kernels).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "api/attention_problem.h"
#include "kvcache/kv_store.h"
#include "memory/tensor_bytes.h"

namespace flashserve {

class PinnedPool;
class ShmDeviceAccess;

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
  int64_t max_batch_and_heads = 0;  // > 0: the most batch and heads_q each (ValidationLimits)
  std::vector<DeviceDescription> devices;
};

/// Microseconds spent in each phase of one job (0 where a phase does not apply).
struct PhaseTiming {
  int64_t stage_us = 0;  // host copy of the inputs into staging memory (CPU time, not overlapped)
  int64_t h2d_us = 0;
  int64_t compute_us = 0;
  int64_t d2h_us = 0;
};

// Test hooks (--enable_fault_injection only), chosen by a request's request_id
// (edge/grpc/attention_call.h): what a broken device does, on demand.
enum class InjectedFault {
  kNone,
  kDeviceFault,  // fault the device instead of computing (the sticky-error path)
  kDeviceHang,   // never complete, not even when cancelled (CUDA: a kernel spinning 10 minutes)
  kLaunchError,  // a call refused while the job is queued (CUDA: an invalid copy; not sticky)
};

/// One job as a backend receives it: the problem, where its tensors are, and how to run it.
struct BackendJob {
  AttentionProblem problem;
  // Inputs the backend reads directly (ReadsDirectly) and outputs it writes directly
  // (WritesDirectly): the runtime has staged whatever it could not (runtime/tensor_placement.h).
  JobTensors tensors;
  // A job still waiting for a device when this passes is answered DEADLINE_EXCEEDED, not run; a
  // backend that can stop running work (the CPU's) stops it then.
  absl::Time deadline = absl::InfiniteFuture();
  // True once nobody wants the answer (the client went away, the shutdown's grace is over): a
  // backend that can stop running work polls it and answers CANCELLED. Thread-safe; may be empty.
  std::function<bool()> cancelled;
  InjectedFault inject = InjectedFault::kNone;  // test hook (--enable_fault_injection only)
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
  /// Computes the job synchronously into its output targets. `kernel` receives the name of
  /// what ran. RESOURCE_EXHAUSTED when memory for it cannot be had; INTERNAL on a device fault.
  virtual absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) = 0;
  /// Starts the job and returns; `done` is called exactly once when the outputs hold the result
  /// (or with the error), possibly inline, possibly on another thread. The job's input and output
  /// memory must stay valid until then. The default runs Run() inline (the CPU backend: its
  /// thread pool is the parallelism); the CUDA backend returns once the work is queued on a stream.
  /// The job is taken by value: a large request's input pieces (thousands) move, not copy.
  virtual void RunAsync(BackendJob job, JobDone done) {
    JobResult result;
    result.status = Run(job, &result.timing, &result.kernel);
    done(std::move(result));
  }
  /// Whether the backend reads an input in this memory as it is (else the runtime stages it into
  /// staging_pool() buffers first). The default (CPU): contiguous host memory, 16-byte aligned (the
  /// kernels load elements through typed pointers; a gRPC receive slice may start at any byte).
  /// Thread-safe.
  virtual bool ReadsDirectly(const TensorBytes& tensor) const {
    return tensor.contiguous() && reinterpret_cast<uintptr_t>(tensor.data()) % 16 == 0;
  }
  /// Whether the backend writes outputs to this kind of memory well (else the runtime gives it
  /// staging buffers and copies the result out). The default (CPU): any. Thread-safe.
  virtual bool WritesDirectly(MemoryKind kind) const { return true; }
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
  /// The memory of the Sequences API's KV cache (`bytes` of it) and the paged attention over it
  /// (server/kvcache/kv_store.h), with up to `launches_in_flight` decode launches queued on the
  /// device at once (a backend that computes on the caller's thread ignores it); UNIMPLEMENTED
  /// when the backend has none.
  virtual absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CreateKvStore(int64_t bytes,
                                                                          int launches_in_flight) {
    return absl::UnimplementedError("this backend has no KV cache");
  }
  /// What the backend does for clients' shared-memory regions (page-lock system regions, open
  /// CUDA IPC handles: memory/shm_regions.h); nullptr: nothing (system regions stay pageable,
  /// CUDA regions are refused). Lives as long as the backend.
  virtual ShmDeviceAccess* shm_device_access() { return nullptr; }
};

}  // namespace flashserve
