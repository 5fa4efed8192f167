// Decode split kernels for head_dim 64 (fp16, bf16; 16, 32, 64 packed rows per block), and the
// 16-row ones on 128-key tiles (dense K/V, pages >= 64 keys; decode_dispatch.cu).
#include "decode_launch_template.h"

namespace flashserve::kernels::cuda::decode {
FLASHSERVE_DECODE_INSTANCES(, 64)
FLASHSERVE_DECODE_WIDE_INSTANCES()
}  // namespace flashserve::kernels::cuda::decode
