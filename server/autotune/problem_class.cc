#include "autotune/problem_class.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace flashserve {
namespace {

constexpr int kMaxBucket = 1 << 17;

int NextPow2(int n) { return PowerOfTwoBucket(n, kMaxBucket); }

}  // namespace

int PowerOfTwoBucket(int n, int cap) {
  int p = 1;
  while (p < n && p < cap) p <<= 1;
  return p;
}

const char* DTypeKey(kernels::DType d) {
  switch (d) {
    case kernels::DType::kFloat16:
      return "fp16";
    case kernels::DType::kBFloat16:
      return "bf16";
    case kernels::DType::kFloat32:
      return "fp32";
  }
  return "unknown";
}

int SeqlenQBucket(int seqlen_q) { return seqlen_q <= 16 ? 16 : NextPow2(seqlen_q); }
int SeqlenKBucket(int seqlen_k) { return std::max(16, NextPow2(seqlen_k)); }
int GqaBucket(int heads_q, int heads_kv) {
  const int ratio = heads_kv > 0 ? heads_q / heads_kv : 1;
  return std::min(16, NextPow2(std::max(1, ratio)));
}

ProblemClass ClassOf(const kernels::AttentionParams& p, const DeviceIdentity& device) {
  ProblemClass c;
  c.device = device;
  c.dtype = p.dtype;
  c.head_dim = p.head_dim;
  c.causal = p.causal;
  c.gqa_bucket = GqaBucket(p.heads_q, p.heads_kv);
  c.seqlen_q_bucket = SeqlenQBucket(p.seqlen_q);
  c.seqlen_k_bucket = SeqlenKBucket(p.seqlen_k);
  return c;
}

std::string ProblemClass::key() const {
  return absl::StrCat("sm", device.cc_major, device.cc_minor, "|", DTypeKey(dtype), "|d", head_dim,
                      causal ? "|causal" : "|full", "|gqa", gqa_bucket, "|q", seqlen_q_bucket, "|k",
                      seqlen_k_bucket);
}

bool ProblemClass::tunable_live(int sm_count) const {
  const kernels::AttentionParams p = representative(sm_count);
  const double flops = 4.0 * p.batch * p.heads_q * double(p.seqlen_q) * p.seqlen_k * p.head_dim;
  return (causal ? flops / 2 : flops) <= kMaxLiveTuneFlops;
}

kernels::AttentionParams ProblemClass::representative(int sm_count) const {
  const int heads_kv = std::max(1, 16 / gqa_bucket);
  const int heads_q = heads_kv * gqa_bucket;
  // Query tiles of 128 rows per (batch, head); aim for >= 4 waves of blocks, and cap the
  // batch so the K/V of one problem stay under ~1 GiB.
  const int64_t tiles_per_batch = int64_t{heads_q} * ((seqlen_q_bucket + 127) / 128);
  const int64_t wanted_blocks = int64_t{std::max(1, sm_count)} * 4;
  int64_t batch = std::max<int64_t>(1, (wanted_blocks + tiles_per_batch - 1) / tiles_per_batch);
  const int64_t kv_bytes_per_batch = int64_t{seqlen_k_bucket} * heads_kv * head_dim * 2 * 2;
  batch = std::min<int64_t>(batch, std::max<int64_t>(1, (int64_t{1} << 30) / kv_bytes_per_batch));
  batch = std::min<int64_t>(batch, 256);
  const float scale = 1.0f / std::sqrt(float(head_dim));
  return kernels::make_contiguous_params(dtype, int(batch), seqlen_q_bucket, seqlen_k_bucket,
                                         heads_q, heads_kv, head_dim, causal, scale);
}

}  // namespace flashserve
