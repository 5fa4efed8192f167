#include "loadgen_regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "loadgen_workload.h"  // Authorize

#ifdef FLASHSERVE_LOADGEN_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flashserve::loadgen {
namespace {

using Stub = inference::GRPCInferenceService::Stub;

std::function<void()> Unregisterer(Stub* stub, const std::string& path, const std::string& name,
                                   const std::string& token) {
  return [stub, path, name, token] {
    grpc::ClientContext ctx;
    Authorize(&ctx, token);
    if (path == "cuda") {
      inference::CudaSharedMemoryUnregisterRequest req;
      req.set_name(name);
      inference::CudaSharedMemoryUnregisterResponse resp;
      stub->CudaSharedMemoryUnregister(&ctx, req, &resp);
    } else {
      inference::SystemSharedMemoryUnregisterRequest req;
      req.set_name(name);
      inference::SystemSharedMemoryUnregisterResponse resp;
      stub->SystemSharedMemoryUnregister(&ctx, req, &resp);
    }
  };
}

bool RegisterSystem(Region* r, const std::string& key, Stub* stub, const std::string& token,
                    std::string* error) {
  inference::SystemSharedMemoryRegisterRequest req;
  req.set_name(r->name);
  req.set_key(key);
  req.set_byte_size(r->bytes);
  inference::SystemSharedMemoryRegisterResponse resp;
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  const grpc::Status s = stub->SystemSharedMemoryRegister(&ctx, req, &resp);
  if (!s.ok()) *error = "SystemSharedMemoryRegister " + r->name + ": " + s.error_message();
  return s.ok();
}

std::unique_ptr<Region> SystemRegion(const std::string& name, size_t bytes, Stub* stub,
                                     const std::string& token, std::string* error) {
  auto r = std::make_unique<Region>();
  r->name = name;
  r->path = "system";
  r->bytes = bytes;
  const std::string key = "/" + name + "_" + std::to_string(getpid());
  const int fd = shm_open(key.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  if (fd < 0 || ftruncate(fd, off_t(bytes)) != 0) {
    *error = "shm_open/ftruncate " + key + ": " + std::strerror(errno);
    if (fd >= 0) close(fd);
    shm_unlink(key.c_str());
    return nullptr;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    *error = "mmap " + key + ": " + std::strerror(errno);
    shm_unlink(key.c_str());
    return nullptr;
  }
  r->host = static_cast<char*>(p);
  r->release = [p, bytes, key] {
    munmap(p, bytes);
    shm_unlink(key.c_str());
  };
  if (!RegisterSystem(r.get(), key, stub, token, error)) return nullptr;
  r->release = [unregister = Unregisterer(stub, "system", name, token), p, bytes, key] {
    unregister();
    munmap(p, bytes);
    shm_unlink(key.c_str());
  };
  return r;
}

#ifdef FLASHSERVE_LOADGEN_CUDA
std::unique_ptr<Region> CudaRegion(const std::string& name, size_t bytes, int device, Stub* stub,
                                   const std::string& token, std::string* error) {
  auto r = std::make_unique<Region>();
  r->name = name;
  r->path = "cuda";
  r->bytes = bytes;
  cudaSetDevice(device);
  cudaIpcMemHandle_t handle;
  if (cudaMalloc(&r->device, bytes) != cudaSuccess ||
      cudaIpcGetMemHandle(&handle, r->device) != cudaSuccess) {
    *error = std::string("cudaMalloc/cudaIpcGetMemHandle: ") +
             cudaGetErrorString(cudaGetLastError());
    return nullptr;
  }
  r->release = [p = r->device] { cudaFree(p); };
  inference::CudaSharedMemoryRegisterRequest req;
  req.set_name(name);
  req.set_raw_handle(std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  req.set_device_id(device);
  req.set_byte_size(bytes);
  inference::CudaSharedMemoryRegisterResponse resp;
  grpc::ClientContext ctx;
  Authorize(&ctx, token);
  const grpc::Status s = stub->CudaSharedMemoryRegister(&ctx, req, &resp);
  if (!s.ok()) {
    *error = "CudaSharedMemoryRegister " + name + ": " + s.error_message();
    return nullptr;
  }
  r->release = [unregister = Unregisterer(stub, "cuda", name, token), p = r->device] {
    unregister();
    cudaFree(p);
  };
  return r;
}
#endif

}  // namespace

bool HaveCudaRegions() {
#ifdef FLASHSERVE_LOADGEN_CUDA
  return true;
#else
  return false;
#endif
}

std::unique_ptr<Region> MakeRegion(const std::string& path, const std::string& name, size_t bytes,
                                   int device, Stub* stub, const std::string& token,
                                   std::string* error) {
  if (path == "system") return SystemRegion(name, bytes, stub, token, error);
#ifdef FLASHSERVE_LOADGEN_CUDA
  if (path == "cuda") return CudaRegion(name, bytes, device, stub, token, error);
#endif
  (void)device;
  *error = "shared-memory path '" + path + "' is not available in this build (cuda needs a CUDA build)";
  return nullptr;
}

bool WriteRegion(Region* region, size_t offset, const void* data, size_t bytes,
                 std::string* error) {
  if (offset > region->bytes || bytes > region->bytes - offset) {
    *error = "write past the end of region " + region->name;
    return false;
  }
  if (region->host != nullptr) {
    std::memcpy(region->host + offset, data, bytes);
    return true;
  }
#ifdef FLASHSERVE_LOADGEN_CUDA
  if (cudaMemcpy(static_cast<char*>(region->device) + offset, data, bytes,
                 cudaMemcpyHostToDevice) == cudaSuccess) {
    return true;
  }
#endif
  *error = "copy into region " + region->name + " failed";
  return false;
}

bool Poison(Region* region, size_t offset, size_t bytes, std::string* error) {
  const std::string poison(bytes, '\xff');
  return WriteRegion(region, offset, poison.data(), bytes, error);
}

bool CheckWritten(const Region& region, size_t offset, size_t bytes, std::string* error) {
  if (offset > region.bytes || bytes > region.bytes - offset) {
    *error = "check past the end of region " + region.name;
    return false;
  }
  std::string copy(bytes, '\0');
  if (region.host != nullptr) {
    std::memcpy(copy.data(), region.host + offset, bytes);
  }
#ifdef FLASHSERVE_LOADGEN_CUDA
  else if (cudaMemcpy(copy.data(), static_cast<const char*>(region.device) + offset, bytes,
                      cudaMemcpyDeviceToHost) != cudaSuccess) {
    *error = "copy out of region " + region.name + " failed";
    return false;
  }
#endif
  for (size_t i = 0; i + 1 < bytes; i += 2) {
    if (static_cast<unsigned char>(copy[i]) == 0xff && static_cast<unsigned char>(copy[i + 1]) == 0xff) {
      *error = "output not written: region " + region.name + " still holds the poison at offset " +
               std::to_string(offset + i);
      return false;
    }
  }
  return true;
}

}  // namespace flashserve::loadgen
