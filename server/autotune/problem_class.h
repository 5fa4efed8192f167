// Problem classes: problems that want the same kernel configuration share one autotuning result.
#pragma once

#include <string>

#include "flashserve/kernels/attention_params.h"

namespace flashserve {

/// The GPU a tuning result belongs to.
struct DeviceIdentity {
  std::string name;  // cudaDeviceProp::name, e.g. "NVIDIA H100 80GB HBM3"
  int cc_major = 0;
  int cc_minor = 0;
  // cudaDeviceProp::multiProcessorCount: a MIG slice keeps its GPU's name and compute capability,
  // and the split-KV plans and grids a tuning result picked were timed for this many SMs.
  int sm_count = 0;
};

/// Bucketing (and why):
///  - seqlen_q: <= 16 is one "decode" class (a single query tile, where the grid is too small to
///    fill the GPU and block_m matters most); above, the next power of two. Tile efficiency,
///    tail waste and occupancy change gradually with length, so a factor of 2 captures them.
///  - seqlen_k: the next power of two, at least 16 (the inner-loop trip count).
///  - GQA ratio heads_q / heads_kv: 1, 2, 4, 8, 16+ (next power of two, capped): it changes how
///    much K/V blocks share through L2, not the inner loop.
///  - Lengths above 2^17 share the top bucket.
/// dtype, head_dim and causal are exact: each selects different compiled code.
struct ProblemClass {
  DeviceIdentity device;
  kernels::DType dtype = kernels::DType::kFloat16;
  int head_dim = 0;
  bool causal = false;
  int gqa_bucket = 1;
  int seqlen_q_bucket = 0;
  int seqlen_k_bucket = 0;

  /// Stable text key for the cache, e.g. "sm90|bf16|d128|causal|gqa4|q4096|k4096".
  /// The device name is not in the key: a cache file belongs to one device (its header).
  std::string key() const;

  /// A problem of this class to time candidates on: the bucket's lengths with enough
  /// batch x heads to fill `sm_count` multiprocessors several times over.
  kernels::AttentionParams representative(int sm_count) const;
  /// Whether the background tuner may time this class while the server serves: its
  /// representative's work stays under kMaxLiveTuneFlops. A class past it (a client's 131072 x
  /// 131072 request made the tuner spend ~85 s of GPU and ~4.5 GiB beside live requests, 256 such
  /// classes queued) keeps the heuristic choice unless flashserve-tune tuned it offline.
  bool tunable_live(int sm_count) const;
  static constexpr double kMaxLiveTuneFlops = 1e13;  // ~25 ms a run at 400 TFLOPS

  friend bool operator==(const ProblemClass& a, const ProblemClass& b) {
    return a.key() == b.key();
  }
};

/// The smallest power of two >= n, at most `cap` (bucket bounds of every problem class).
int PowerOfTwoBucket(int n, int cap);
/// A dtype as cache keys spell it: "fp16", "bf16", "fp32".
const char* DTypeKey(kernels::DType d);
int SeqlenQBucket(int seqlen_q);
int SeqlenKBucket(int seqlen_k);
int GqaBucket(int heads_q, int heads_kv);

ProblemClass ClassOf(const kernels::AttentionParams& p, const DeviceIdentity& device);

}  // namespace flashserve
