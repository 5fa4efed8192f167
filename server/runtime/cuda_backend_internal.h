// CudaBackend's private types, shared by its two files: cuda_backend.cc (devices, streams, slots,
// the KV store) and cuda_backend_jobs.cc (one attention request from launch to completion).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "memory/io_buffers.h"
#include "runtime/copy_pipeline.h"
#include "runtime/cuda_backend.h"
#include "runtime/cuda_transfer.h"

namespace flashserve {

// One request between launch and completion. Byte layout of both the device buffer and the
// request buffers: IoLayout (q | k | v | o | lse, each part 256-byte aligned).
struct CudaBackend::Job {
  BackendJob spec;
  IoLayout layout;  // of the device buffer
  JobDone done;
  kernels::cuda::KernelConfig config;
  int chunks = 1;  // > 1: copies and kernel pipelined over head chunks (runtime/copy_pipeline.h)
  cudaError_t launch_error = cudaSuccess;  // the first error while queueing the work
  const char* failed_step = "";

  // Keeps the first failure of a queued step; true while none has failed.
  bool Step(cudaError_t result, const char* what) {
    if (result != cudaSuccess && launch_error == cudaSuccess) {
      launch_error = result;
      failed_step = what;
    }
    return launch_error == cudaSuccess;
  }
};

// A stream with its timing events and the thread that completes its jobs, one job at a time.
struct CudaBackend::Slot {
  Device* device = nullptr;
  cudaStream_t stream = nullptr;
  // start, after H2D, after kernel, after D2H (polled by the completion thread), and a copy of the
  // last with cudaEventBlockingSync and no timing, which the completion thread sleeps on once
  // polling has taken longer than completion_spin_us.
  cudaEvent_t events[5] = {};
  std::mutex mu;
  std::condition_variable cv;
  std::unique_ptr<Job> job;  // guarded by mu: handed over by the launching worker
  bool exiting = false;      // guarded by mu
  std::thread completer;
  BatchCopy batch;  // used by the launching thread while it holds the slot
  std::unique_ptr<CopyPipeline> pipeline;  // with --copy_pipeline_chunks > 1 only
};

struct CudaBackend::Device {
  int index = 0;
  int sm_count = 0;
  bool tuned = false;  // same model as the first device: uses the tuning cache (KernelChooser)
  std::vector<std::unique_ptr<Slot>> slots;
  // Guarded by CudaBackend::mu_.
  std::vector<Slot*> free_slots;
  int64_t outstanding_bytes = 0;  // device bytes of the jobs on this device now
  int in_flight = 0;
  uint64_t last_chosen = 0;  // AcquireSlot's count when it last picked this device
};

}  // namespace flashserve
