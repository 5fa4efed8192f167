// The load generators' own shared-memory regions (Triton's shared-memory extension), registered
// with the server over KServe gRPC: "system" = a POSIX shm object of this process; "cuda" =
// cudaMalloc'd memory shared by its IPC handle (CUDA builds only: FLASHSERVE_LOADGEN_CUDA).
// A Region unregisters itself, then frees its memory, when destroyed.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "inference/open_inference_grpc.grpc.pb.h"

namespace flashserve::loadgen {

struct Region {
  std::string name, path;  // path: "system" or "cuda"
  char* host = nullptr;    // system: the mapping
  void* device = nullptr;  // cuda: the allocation
  size_t bytes = 0;
  std::function<void()> release;  // unregister, then unmap / free
  ~Region() {
    if (release) release();
  }
};

/// Creates a region of `bytes` of `path` ("system" or "cuda"; cuda on `device`) and registers it
/// as `name` (with a bearer `token` when non-empty). nullptr with *error on failure: a path this
/// build lacks, shm_open / cudaMalloc failing, or the server refusing the registration.
std::unique_ptr<Region> MakeRegion(const std::string& path, const std::string& name, size_t bytes,
                                   int device, inference::GRPCInferenceService::Stub* stub,
                                   const std::string& token, std::string* error);

/// Copies `bytes` from host memory to `offset` in the region (a memcpy or a cudaMemcpy).
bool WriteRegion(Region* region, size_t offset, const void* data, size_t bytes, std::string* error);

/// Output checks: Poison fills [offset, offset + bytes) with 0xFF bytes (a NaN in fp16 and bf16);
/// CheckWritten fails, naming the first one, if any 16-bit word there is still 0xFFFF afterwards,
/// i.e. the server did not write its output there (a real O holds no NaN for finite inputs).
bool Poison(Region* region, size_t offset, size_t bytes, std::string* error);
bool CheckWritten(const Region& region, size_t offset, size_t bytes, std::string* error);

/// Whether this build has CUDA regions.
bool HaveCudaRegions();

}  // namespace flashserve::loadgen
