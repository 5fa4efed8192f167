// The compute backend interface: CPU (thread pool) or CUDA (GPU kernels).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "api/attention_problem.h"

namespace flashserve {

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
  int64_t h2d_us = 0;
  int64_t compute_us = 0;
  int64_t d2h_us = 0;
};

/// Where a job's results go: host memory owned by the response message.
struct JobOutput {
  void* out = nullptr;   // out_bytes() bytes, dtype of the problem
  float* lse = nullptr;  // lse_elements() floats, or nullptr
};

/// Thread-safe: Run is called concurrently from the scheduler's workers.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const BackendCapabilities& capabilities() const = 0;
  /// Computes the problem synchronously into `output`. `kernel` receives the name of
  /// what ran. RESOURCE_EXHAUSTED when memory for it cannot be had; INTERNAL on a device fault.
  virtual absl::Status Run(const AttentionProblem& problem, const JobOutput& output,
                           PhaseTiming* timing, std::string* kernel) = 0;
  /// False after a fault that makes the backend unusable (a sticky CUDA error).
  virtual bool healthy() const { return true; }
  /// Bytes in use and reserved by the device memory pool of `device`; false when the backend
  /// has no such pool. Thread-safe (called from the metrics scrape).
  virtual bool DevicePoolBytes(int device, int64_t* used, int64_t* reserved) const {
    return false;
  }
};

}  // namespace flashserve
