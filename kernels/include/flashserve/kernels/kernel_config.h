// One point of the forward kernels' configuration space: the sm80 family (mma.sync, any GPU from
// sm_80 on) or the sm90 family (wgmma + TMA + warp specialization, sm_90a only).
// Plain C++ (no CUDA headers): the autotuner cache and the server use it without nvcc.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace flashserve::kernels::cuda {

/// Kernel family: the instruction set a configuration is built on.
enum class KernelFamily {
  kSm80,  ///< kernels/cuda/*.h: FlashAttention-2 style, mma.sync; runs on sm_80 and later
  kSm90,  ///< kernels/cuda/sm90/: FlashAttention-3 style, wgmma + TMA; runs on sm_90 only
};

/// A compiled configuration of the forward kernel. The fields become template parameters
/// (see kernels/cuda/kernel_traits.h); only the configurations that
/// kernels/tools/generate_instances.py instantiated can run (candidates() lists them).
struct KernelConfig {
  int block_m = 128;       ///< query rows per thread block (16 * num_warps * m-tiles per warp)
  int block_n = 64;        ///< key/value rows per inner-loop step
  int num_warps = 4;       ///< warps per block; each warp owns block_m / num_warps query rows
  int kv_stages = 2;       ///< shared-memory K/V buffers: 1 (FA2-style) or 2 (double-buffered)
  bool q_in_regs = false;  ///< keep the Q tile in registers instead of re-reading shared memory
  /// Lazy online-softmax rescale (FlashAttention-4): a row's running max, and with it O and the
  /// row sum, is only updated when the max grows by more than kLazyRescaleThresholdLog2 (in the
  /// log2 domain); P is computed against the stale max meanwhile, so it can reach 2^threshold
  /// before it is rounded to the element type. false: exact rescale on every K/V tile (FA2).
  bool lazy_rescale = false;
  /// sm90: block_m is 128 or 192 (2 or 3 consumer warpgroups), num_warps 12 or 16 (with the
  /// producer warpgroup), q_in_regs false and lazy_rescale true; block_n and kv_stages vary.
  KernelFamily family = KernelFamily::kSm80;

  /// The lazy rescale's threshold: rescale when (new max - running max) * scale * log2(e) > 8.
  /// 2^8 keeps P (rounded to fp16/bf16 for P*V) and the row sums far from overflow; the fp32 O
  /// accumulator holds up to 2^8 x keys x max|V| before the final 1 / sum (bf16 V near 1e34 with
  /// thousands of keys overflows it: O = inf, README "Numerics").
  static constexpr float kLazyRescaleThresholdLog2 = 8.f;
  /// The threshold this configuration uses (0: rescale whenever the max grows).
  float rescale_threshold_log2() const { return lazy_rescale ? kLazyRescaleThresholdLog2 : 0.f; }

  /// Stable text form, e.g. "m128n64w4s2", "m128n64w8s2q" or "m128n64w4s2l" (lazy rescale);
  /// sm90 configurations carry a prefix: "sm90m128n128w12s2l". The autotuner cache stores it.
  std::string name() const;
  /// Inverse of name(); nullopt for text that is not a well-formed name.
  static std::optional<KernelConfig> parse(std::string_view name);

  friend bool operator==(const KernelConfig& a, const KernelConfig& b) {
    return a.block_m == b.block_m && a.block_n == b.block_n && a.num_warps == b.num_warps &&
           a.kv_stages == b.kv_stages && a.q_in_regs == b.q_in_regs &&
           a.lazy_rescale == b.lazy_rescale && a.family == b.family;
  }
  /// The sm90 configuration with block_n keys per step, kv_stages K/V buffers and block_m / 64
  /// consumer warpgroups (+ the producer warpgroup).
  static KernelConfig sm90(int block_n, int kv_stages, int block_m = 128) {
    KernelConfig c{block_m, block_n, 4 * (block_m / 64 + 1), kv_stages, false, true};
    c.family = KernelFamily::kSm90;
    return c;
  }

  friend bool operator!=(const KernelConfig& a, const KernelConfig& b) { return !(a == b); }
};

}  // namespace flashserve::kernels::cuda
