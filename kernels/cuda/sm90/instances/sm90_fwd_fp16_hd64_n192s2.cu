// One sm90 instance (listed in ../registry.h). Compiled only for sm_90a.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../launch.h"

namespace flashserve::kernels::cuda::sm90 {
template cudaError_t launch_sm90<Sm90Traits<__half, 64, 192, 2, 2>>(const AttentionParams&,
                                                                    cudaStream_t);
}  // namespace flashserve::kernels::cuda::sm90
