// make_tensor_map: cuTensorMapEncodeTiled through the runtime's driver entry-point lookup
// (tensor_map_encode.h).
#include "tensor_map.h"

#include <cstring>

#include "tensor_map_encode.h"

namespace flashserve::kernels::cuda::sm90 {
namespace {

constexpr int64_t kMaxStrideBytes = int64_t{1} << 40;

// A dimension of extent 1 never moves, so its stride is free: use a harmless legal value.
bool stride_bytes(int64_t stride_elems, int extent, int64_t fallback, cuuint64_t* out) {
  int64_t bytes = stride_elems * 2;
  if (extent <= 1) bytes = fallback;
  if (bytes <= 0 || bytes % 16 != 0 || bytes >= kMaxStrideBytes) return false;
  *out = cuuint64_t(bytes);
  return true;
}

bool strides(const TensorView& v, cuuint64_t (&out)[3]) {
  const int64_t row_bytes = int64_t(v.head_dim) * 2;
  return stride_bytes(v.row_stride, v.seqlen, row_bytes, &out[0]) &&
         stride_bytes(v.head_stride, v.heads, row_bytes, &out[1]) &&
         stride_bytes(v.batch_stride, v.batch, row_bytes, &out[2]);
}

}  // namespace

bool tensor_map_strides_ok(const TensorView& view) {
  cuuint64_t s[3];
  return strides(view, s);
}

cudaError_t make_tensor_map(const TensorView& v, int box_rows, CUtensorMap* map) {
  std::memset(map, 0, sizeof(*map));
  if (v.seqlen <= 0) return cudaSuccess;  // never read (no tile to load)
  cuuint64_t global_strides[3];
  if (!strides(v, global_strides)) return cudaErrorInvalidValue;
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[4] = {cuuint64_t(v.head_dim), cuuint64_t(v.seqlen), cuuint64_t(v.heads),
                              cuuint64_t(v.batch)};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = v.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r =
      encode(map, type, 4, const_cast<void*>(v.base), dims, global_strides, box, element_strides,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace flashserve::kernels::cuda::sm90
