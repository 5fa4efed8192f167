// make_kv_tensor_map: cuTensorMapEncodeTiled through the runtime's driver entry-point lookup
// (tensor_map_encode.h: nothing links libcuda, and this file builds without sm_90 in the archs).
#include "decode_tensor_map.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "tensor_map_encode.h"

namespace flashserve::kernels::cuda::decode {
namespace {

// TMA strides: multiples of 16 bytes below 2^40; a dimension of extent 1 never moves, so any
// legal value will do there.
bool stride_bytes(int64_t elems, uint64_t extent, cuuint64_t* out) {
  const int64_t bytes = extent <= 1 ? 128 : elems * 2;
  if (bytes <= 0 || bytes % 16 != 0 || bytes >= (int64_t{1} << 40)) return false;
  *out = cuuint64_t(bytes);
  return true;
}

}  // namespace

int tma_box_rows(const DecodeParams& p, int block_n) {
  if (p.head_dim % 32 != 0 || p.cu_seqlens_k != nullptr) return 0;
  if (p.block_table == nullptr) return block_n;
  if (p.page_size < 8 || (p.page_size & (p.page_size - 1)) != 0) return 0;
  const int rows = std::min(p.page_size, block_n);
  const int slices = p.head_dim / tma_slice_cols(p.head_dim);
  return 2 * slices * (block_n / rows) <= 32 ? rows : 0;
}

bool make_kv_tensor_map(const DecodeParams& p, bool is_v, int box_rows, bool wide, int l2_bytes,
                        CUtensorMap* map) {
  std::memset(map, 0, sizeof(*map));
  const EncodeTiledFn encode = encode_tiled();
  if (encode == nullptr || box_rows < 1 || box_rows > 256) return false;
  const bool paged = p.block_table != nullptr;
  // Paged: the pool's page count is not a parameter; the block table is trusted as on the
  // cp.async path, so the page extent is only an upper bound.
  const uint64_t rows = paged ? uint64_t(p.page_size) : uint64_t(std::max(p.seqlen_k, 1));
  const uint64_t pages = paged ? uint64_t{INT32_MAX} : uint64_t(std::max(p.batch, 1));
  const int slice = tma_slice_cols(p.head_dim);
  const cuuint64_t dims[5] = {cuuint64_t(slice), rows, cuuint64_t(p.head_dim / slice),
                              cuuint64_t(p.heads_kv), pages};
  cuuint64_t strides[4];
  if (!stride_bytes(is_v ? p.v_row_stride : p.k_row_stride, rows, &strides[0]) ||
      !stride_bytes(slice, dims[2], &strides[1]) ||
      !stride_bytes(is_v ? p.v_head_stride : p.k_head_stride, dims[3], &strides[2]) ||
      !stride_bytes(is_v ? p.v_batch_stride : p.k_batch_stride, pages, &strides[3]))
    return false;
  const cuuint32_t box[5] = {cuuint32_t(slice), cuuint32_t(box_rows),
                             wide ? cuuint32_t(dims[2]) : 1u, 1, 1};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type = p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUtensorMapL2promotion l2 = l2_bytes >= 256   ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                                    : l2_bytes >= 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                                      : CU_TENSOR_MAP_L2_PROMOTION_NONE;
  return encode(map, type, 5, const_cast<void*>(is_v ? p.v : p.k), dims, strides, box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                slice == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, l2,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace flashserve::kernels::cuda::decode
