// Decode split kernels for head_dim 32 (fp16, bf16; 16, 32, 64 packed rows per block).
#include "decode_launch_template.h"

namespace flashserve::kernels::cuda::decode {
FLASHSERVE_DECODE_INSTANCES(, 32)
}  // namespace flashserve::kernels::cuda::decode
