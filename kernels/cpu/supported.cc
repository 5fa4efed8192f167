// cpu::supported: which problems the CPU backend accepts, with a message naming the field.
#include <cmath>
#include <string>

#include "flashserve/kernels/cpu_attention.h"

namespace flashserve::kernels::cpu {

std::string supported(const AttentionParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat32) {
    return "dtype " + std::to_string(static_cast<int>(p.dtype)) +
           " is not supported by the CPU backend (float16, bfloat16, float32)";
  }
  const struct {
    const char* name;
    int value;
  } sizes[] = {{"batch", p.batch},     {"seqlen_q", p.seqlen_q}, {"seqlen_k", p.seqlen_k},
               {"heads_q", p.heads_q}, {"heads_kv", p.heads_kv}, {"head_dim", p.head_dim}};
  for (const auto& size : sizes) {
    if (size.value <= 0)
      return std::string(size.name) + " must be > 0, got " + std::to_string(size.value);
  }
  if (p.heads_q % p.heads_kv != 0) {
    return "heads_q " + std::to_string(p.heads_q) + " is not a multiple of heads_kv " +
           std::to_string(p.heads_kv);
  }
  if (p.head_dim > kMaxHeadDim) {
    return "head_dim " + std::to_string(p.head_dim) + " exceeds the CPU backend maximum " +
           std::to_string(kMaxHeadDim);
  }
  if (p.q == nullptr) return "q is null";
  if (p.k == nullptr) return "k is null";
  if (p.v == nullptr) return "v is null";
  if (p.o == nullptr) return "o is null";
  if (!std::isfinite(p.softmax_scale) || !(p.softmax_scale > 0.f)) {
    return "softmax_scale must be finite and > 0, got " + std::to_string(p.softmax_scale);
  }
  return {};
}

}  // namespace flashserve::kernels::cpu
