// cuTensorMapEncodeTiled without linking libcuda: the driver function, looked up once through the
// runtime's entry-point query. Shared by the sm90 prefill family (sm90/tensor_map.cc) and the
// decode kernels' TMA path (decode/decode_tensor_map.cc).
#pragma once

#include <cuda.h>

namespace flashserve::kernels::cuda {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/// nullptr when the driver lacks it (older than CUDA 12.0).
EncodeTiledFn encode_tiled();

}  // namespace flashserve::kernels::cuda
