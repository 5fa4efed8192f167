// Problem classes of the split-KV decode kernel: decode problems that want the same number of
// key-axis splits share one tuning result. CPU-only (no CUDA types), so the keys are testable
// without a GPU; cuda_tuning.cc converts kernels::cuda::DecodeParams to a DecodeShape.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "autotune/problem_class.h"
#include "flashserve/kernels/dtype.h"

namespace flashserve {

/// The sizes of one decode launch that the split count depends on.
struct DecodeShape {
  kernels::DType dtype = kernels::DType::kBFloat16;
  int head_dim = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int batch = 0;
  int seqlen_q = 0;   // rows per sequence (varlen: the maximum)
  int seqlen_k = 0;   // keys per sequence (varlen/paged: the maximum)
  int page_size = 0;  // 0: dense K/V
  bool causal = false;
};

/// Bucketing (and why): the split count follows from the number of blocks (batch x KV heads x
/// row blocks, against the SMs' slots) and from the key tiles per sequence, so
///  - heads_kv, GQA group, head_dim, dtype, causal: exact (a model has one of each; the group
///    and seqlen_q decide the kernel's rows per block);
///  - seqlen_q: 1, 2, 4, 8, 16 (next power of two; decode and speculative verification);
///  - batch: next power of two, capped at 1024 (a serving batch changes every step; powers of two
///    keep a model at ~11 batch classes);
///  - seqlen_k: next power of two, at least 64 (one key tile), capped at 2^20;
///  - page size: 0 (dense) or the next power of two, capped at 256 (paged lookups differ).
/// Each class is tuned on its largest member (the bucket's upper bounds); a count is pinned for
/// the class only where it clearly beats the heuristic there (DecodeTunedConfig), since the best
/// count for a smaller batch of the bucket can differ.
struct DecodeClass {
  DeviceIdentity device;
  kernels::DType dtype = kernels::DType::kBFloat16;
  int head_dim = 0;
  bool causal = false;
  int heads_kv = 0;
  int group = 1;  // heads_q / heads_kv
  int seqlen_q_bucket = 1;
  int batch_bucket = 1;
  int seqlen_k_bucket = 64;
  int page_bucket = 0;

  /// Stable cache key, e.g. "decode|sm90|bf16|d128|full|kv8|g4|q1|b64|k8192|p64". The "decode|"
  /// prefix keeps these apart from the attention classes' keys in the same cache file.
  std::string key() const;
  /// The shape the class is tuned on: every size at its bucket's upper bound, except that
  /// seqlen_k is halved (not below 1024) while K and V together exceed max_kv_bytes: the tuner
  /// allocates its own K/V next to the server's KV cache. The split count depends on the blocks
  /// per wave, which this keeps, and on keys per split only through a minimum of two tiles.
  DecodeShape representative(int64_t max_kv_bytes = int64_t{2} << 30) const;
};

/// nullopt when s is not a decode problem the classes cover (sizes < 1, heads_q not a multiple
/// of heads_kv, seqlen_q > 16): such problems keep the kernel's heuristic.
std::optional<DecodeClass> DecodeClassOf(const DecodeShape& s, const DeviceIdentity& device);

/// The cache's config text for a split count ("splits=32"; 0: "splits=plan", the kernel's
/// heuristic for each launch's own shape) and back (0 for "splits=plan"; nullopt unless it is
/// exactly "splits=N" with N in 1..128 or "splits=plan").
std::string DecodeSplitsConfig(int num_splits);
std::optional<int> ParseDecodeSplitsConfig(const std::string& config);

/// How much faster than the heuristic, on the class's representative, a tuned count must run to
/// be pinned for the whole class. A pinned count serves every batch of the bucket (up to half the
/// representative's), whose waves differ: on an H200 (session 29) the heuristic's count for the
/// batch's own shape ran 1.10-1.15x as fast as the count tuned at B64 (d128 B36-B44 Sk8k) and
/// 1.10-1.25x as fast as the one tuned at B16 (d64 MHA B9-B11 Sk16k). Timing noise between runs
/// is ~1-3%.
inline constexpr double kDecodePinMargin = 0.03;

/// The config a tuned class records: the best count when it beat the heuristic's count by more
/// than kDecodePinMargin (best_ms, heuristic_ms: their median times on the representative; a
/// heuristic_ms <= 0 means the heuristic's count did not run correctly), else "splits=plan".
std::string DecodeTunedConfig(int best_splits, double best_ms, double heuristic_ms);

/// The split count a decode launch runs with, given its class's cached config (nullopt: none):
/// the pinned count, else `heuristic` (the kernel's count for the launch's own shape), also for
/// "splits=plan" and for a malformed entry.
int DecodeSplitsFromConfig(const std::optional<std::string>& config, int heuristic);

}  // namespace flashserve
