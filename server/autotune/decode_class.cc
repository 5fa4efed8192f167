#include "autotune/decode_class.h"

#include <algorithm>
#include <charconv>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace flashserve {
namespace {

constexpr int kMaxSeqlenQ = 16;   // the decode kernels' query rows per sequence
constexpr int kMaxSplits = 128;   // kernels::cuda::DecodeParams::num_splits
constexpr int kMaxBatchBucket = 1024;
constexpr int kMaxSeqlenKBucket = 1 << 20;
constexpr int kMaxPageBucket = 256;
constexpr char kPlan[] = "plan";  // "splits=plan": the heuristic per launch

}  // namespace

std::optional<DecodeClass> DecodeClassOf(const DecodeShape& s, const DeviceIdentity& device) {
  if (s.head_dim < 1 || s.heads_kv < 1 || s.heads_q < s.heads_kv || s.heads_q % s.heads_kv != 0 ||
      s.batch < 1 || s.seqlen_q < 1 || s.seqlen_q > kMaxSeqlenQ || s.seqlen_k < 1 ||
      s.page_size < 0) {
    return std::nullopt;
  }
  DecodeClass c;
  c.device = device;
  c.dtype = s.dtype;
  c.head_dim = s.head_dim;
  c.causal = s.causal;
  c.heads_kv = s.heads_kv;
  c.group = s.heads_q / s.heads_kv;
  c.seqlen_q_bucket = PowerOfTwoBucket(s.seqlen_q, kMaxSeqlenQ);
  c.batch_bucket = PowerOfTwoBucket(s.batch, kMaxBatchBucket);
  c.seqlen_k_bucket = std::max(64, PowerOfTwoBucket(s.seqlen_k, kMaxSeqlenKBucket));
  c.page_bucket = s.page_size == 0 ? 0 : PowerOfTwoBucket(s.page_size, kMaxPageBucket);
  return c;
}

std::string DecodeClass::key() const {
  return absl::StrCat("decode|sm", device.cc_major, device.cc_minor, "|", DTypeKey(dtype), "|d",
                      head_dim, causal ? "|causal" : "|full", "|kv", heads_kv, "|g", group, "|q",
                      seqlen_q_bucket, "|b", batch_bucket, "|k", seqlen_k_bucket, "|p",
                      page_bucket);
}

DecodeShape DecodeClass::representative(int64_t max_kv_bytes) const {
  DecodeShape s;
  s.dtype = dtype;
  s.head_dim = head_dim;
  s.heads_kv = heads_kv;
  s.heads_q = heads_kv * group;
  s.batch = batch_bucket;
  s.seqlen_q = seqlen_q_bucket;
  s.seqlen_k = seqlen_k_bucket;
  s.page_size = page_bucket;
  s.causal = causal;
  const int64_t bytes_per_key = int64_t{2} * heads_kv * head_dim * (dtype == kernels::DType::kFloat32 ? 4 : 2);
  while (s.seqlen_k > 1024 && int64_t{s.batch} * s.seqlen_k * bytes_per_key > max_kv_bytes) s.seqlen_k /= 2;
  return s;
}

std::string DecodeSplitsConfig(int num_splits) {
  return num_splits == 0 ? absl::StrCat("splits=", kPlan) : absl::StrCat("splits=", num_splits);
}

std::optional<int> ParseDecodeSplitsConfig(const std::string& config) {
  constexpr std::string_view kPrefix = "splits=";
  if (config.size() <= kPrefix.size() || config.compare(0, kPrefix.size(), kPrefix) != 0) {
    return std::nullopt;
  }
  if (config.compare(kPrefix.size(), std::string::npos, kPlan) == 0) return 0;
  const char* first = config.data() + kPrefix.size();
  const char* last = config.data() + config.size();
  int n = 0;
  const auto [end, ec] = std::from_chars(first, last, n);
  if (ec != std::errc() || end != last || n < 1 || n > kMaxSplits) return std::nullopt;
  return n;
}

std::string DecodeTunedConfig(int best_splits, double best_ms, double heuristic_ms) {
  const bool pinned = heuristic_ms <= 0 || best_ms < heuristic_ms * (1 - kDecodePinMargin);
  return DecodeSplitsConfig(pinned ? best_splits : 0);
}

int DecodeSplitsFromConfig(const std::optional<std::string>& config, int heuristic) {
  const int tuned = config ? ParseDecodeSplitsConfig(*config).value_or(0) : 0;
  return tuned > 0 ? tuned : heuristic;
}

}  // namespace flashserve
