// What the backends are created from: one options struct per backend, and BackendOptions, which
// holds both and names the one to use. Each field's default is written here and nowhere else
// (server/config/flags.cc takes the flags' defaults from these structs); each struct's range
// checks are its Check(), which names the server flag a bad value came from.
//
// No CUDA header here: a build without CUDA still configures CUDA options (and ignores them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "autotune/background_tuner.h"
#include "autotune/tune_grid.h"

namespace flashserve {

/// The cap of the pool of request buffers both backends keep (--pinned_pool_bytes).
inline constexpr int64_t kDefaultRequestPoolBytes = int64_t{2} << 30;

struct CudaBackendOptions {
  std::vector<int> devices;    // empty: every visible device
  int streams_per_device = 4;  // jobs in flight per device, in [1, 64]
  // A completion thread polls its job's last event for up to this long before it blocks on it:
  // a blocking wait wakes tens of microseconds late, which dominates a small request; polling
  // costs a core only while a job that short is on the device. 0: always block.
  int completion_spin_us = 200;
  // A large request whose tensors are host memory in one page-locked piece each (staged, system
  // shared memory), alone on its GPU, is cut into this many head chunks whose copies overlap each
  // other's kernels (runtime/copy_pipeline.h); 1: off. In [1, 8]. 4: on an H100 a medium (48 MiB)
  // request from a system region takes 1.19 ms instead of 1.45 ms over the local socket
  // (bench/results/service-h100-2026-11-24-pipeline.md).
  int copy_pipeline_chunks = 4;
  // Bytes of freed device memory the stream-ordered pool keeps instead of returning to the driver.
  int64_t device_pool_release_threshold_bytes = int64_t{4} << 30;
  // Cap of the pinned host staging pool; 0 disables pinned staging (pageable copies).
  int64_t pinned_pool_bytes = kDefaultRequestPoolBytes;
  // A request needing more device memory than this gets RESOURCE_EXHAUSTED; 0: no limit.
  int64_t max_device_bytes_per_request = 0;
  // Autotuning (issue 4): "off" uses the cache read-only if given, else the heuristic default;
  // "background" tunes unseen classes off the request path; "startup" tunes startup_grid in
  // Create, before the server reports ready, then continues as "background".
  std::string autotune = "off";
  std::string tune_cache_path;  // "" keeps tuning results in memory only
  TuneGrid startup_grid;
  // Classes the background tuner holds (cached, queued or failed); misses past it keep the default.
  int tune_max_classes = BackgroundTuner::Options{}.max_classes;
  BackgroundTuner::EventFn on_autotune_event;  // "hit", "miss", "tuned", "failed"; may be empty
  // Polled while "startup" tunes: true (a shutdown signal came) ends Create with CANCELLED. May be
  // empty (the tuning then runs to its end).
  std::function<bool()> stop_requested;

  /// INVALID_ARGUMENT naming the flag of the first value out of range.
  absl::Status Check() const;
};

struct CpuBackendOptions {
  static constexpr int kMaxThreads = 1024;
  int num_threads = 0;  // compute threads, at most kMaxThreads; 0: all cores
  // Cap of the pool of request buffers (IoBuffers), reused between requests: a fresh buffer costs
  // page faults on every request (its memory comes from mmap). 0: no pool.
  int64_t buffer_pool_bytes = kDefaultRequestPoolBytes;

  absl::Status Check() const;
};

struct BackendOptions {
  std::string kind = "auto";  // auto: cuda when a usable GPU exists, else cpu
  CudaBackendOptions cuda;
  CpuBackendOptions cpu;

  absl::Status Check() const;  // kind, then both backends' options
};

}  // namespace flashserve
