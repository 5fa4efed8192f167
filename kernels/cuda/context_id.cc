// current_context_id through the driver's entry points, looked up by the runtime (the kernels
// link no libcuda).
#include "context_id.h"

#include <cuda.h>  // CUcontext / CUresult (types only)
#include <cuda_runtime_api.h>

namespace flashserve::kernels::cuda {
namespace {

template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Fn>(fn);
}

}  // namespace

unsigned long long current_context_id() {
  using GetCurrent = CUresult (*)(CUcontext*);
  using GetId = CUresult (*)(CUcontext, unsigned long long*);
  static const GetCurrent get_current = driver_entry<GetCurrent>("cuCtxGetCurrent");
  static const GetId get_id = driver_entry<GetId>("cuCtxGetId");
  CUcontext ctx = nullptr;
  unsigned long long id = 0;
  if (get_current == nullptr || get_id == nullptr || get_current(&ctx) != CUDA_SUCCESS ||
      ctx == nullptr || get_id(ctx, &id) != CUDA_SUCCESS)
    return 0;
  return id;
}

}  // namespace flashserve::kernels::cuda
