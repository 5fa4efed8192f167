// Test helpers: random K/V/Q rows in fp16/bf16, a dense mirror of a sequence, and the check of a
// paged attention result against the fp64 reference over the mirror.
#pragma once

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/float_convert.h"
#include "flashserve/kernels/reference_attention.h"
#include "gtest/gtest.h"
#include "kvcache/kv_types.h"
#include "kvcache/sequence_cache.h"

namespace flashserve::kvcache::testing {

using Bits = std::vector<uint16_t>;

/// Threads wait at it until the test opens it; the test can wait until one is waiting.
class Gate {
 public:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    waiting_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
  }
  void WaitUntilWaiting() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return waiting_; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool waiting_ = false, open_ = false;
};

inline Bits RandomRows(std::mt19937* rng, int64_t rows, int64_t heads, int64_t head_dim,
                       kernels::DType dtype) {
  std::normal_distribution<float> normal(0.f, 1.f);
  Bits bits(size_t(rows * heads * head_dim));
  for (uint16_t& b : bits) {
    const float x = normal(*rng);
    b = dtype == kernels::DType::kFloat16 ? kernels::float_to_half(x) : kernels::float_to_bf16(x);
  }
  return bits;
}

inline HostRows Rows(const Bits& bits, int64_t heads, int64_t head_dim, kernels::DType dtype) {
  HostRows r;
  r.dtype = dtype;
  r.heads = heads;
  r.head_dim = head_dim;
  r.rows = heads * head_dim == 0 ? 0 : int64_t(bits.size()) / (heads * head_dim);
  r.data = bits.data();
  return r;
}

/// A 4 MiB cache of `page_tokens`-token pages over `store` (a test's recording or gated store).
inline std::unique_ptr<SequenceCache> SmallCache(KvStore* store, int page_tokens) {
  KvCacheOptions options;
  options.capacity_bytes = 4 << 20;
  options.page_tokens = page_tokens;
  return std::move(*SequenceCache::Create(options, store, nullptr));
}

/// What one layer of a sequence holds, densely: K and V rows appended in order.
struct DenseLayer {
  Bits k, v;
  void Append(const Bits& new_k, const Bits& new_v) {
    k.insert(k.end(), new_k.begin(), new_k.end());
    v.insert(v.end(), new_v.begin(), new_v.end());
  }
};

/// Checks out/lse of one item against the fp64 reference over the dense layer, with a tolerance
/// of one unit in the last place of the output dtype (the CPU kernel accumulates in fp32 and
/// rounds once) plus a small fp32 slack; with `low_precision_p` (GPU kernels round P to the
/// dtype before P @ V) plus twice the largest error of attention_emulated, the same-precision
/// reference. Returns failures (first few reported).
inline int CheckAgainstReference(const SequenceShape& s, const DenseLayer& layer, const Bits& q,
                                 int rows_q, bool causal, float scale, const Bits& out,
                                 const std::vector<float>& lse, const std::string& where,
                                 bool low_precision_p = false) {
  const int64_t row = int64_t(s.heads_kv) * s.head_dim;
  const int length = int(layer.k.size() / size_t(row));
  std::vector<double> ref_o, ref_lse;
  double emulated_error = 0;
  if (length > 0) {
    kernels::AttentionParams p = kernels::make_contiguous_params(
        s.dtype, 1, rows_q, length, s.heads_q, s.heads_kv, s.head_dim, causal, scale);
    p.q = q.data();
    p.k = layer.k.data();
    p.v = layer.v.data();
    kernels::reference::attention_fp64(p, &ref_o, &ref_lse);
    if (low_precision_p) {
      std::vector<double> emu_o, emu_lse;
      kernels::reference::attention_emulated(p, &emu_o, &emu_lse);
      for (size_t i = 0; i < emu_o.size(); ++i) {
        emulated_error = std::max(emulated_error, std::abs(emu_o[i] - ref_o[i]));
      }
    }
  } else {
    ref_o.assign(out.size(), 0.0);
    ref_lse.assign(lse.size(), -std::numeric_limits<double>::infinity());
  }
  const double ulp =
      s.dtype == kernels::DType::kFloat16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
  int failures = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double o = s.dtype == kernels::DType::kFloat16 ? kernels::half_to_float(out[i])
                                                         : kernels::bf16_to_float(out[i]);
    const double tol = ulp * std::abs(ref_o[i]) + 2 * emulated_error + 1e-5;
    if (!(std::abs(o - ref_o[i]) <= tol) && ++failures <= 3) {
      ADD_FAILURE() << where << ": out[" << i << "] = " << o << " vs " << ref_o[i];
    }
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool both_inf = std::isinf(ref_lse[i]) && lse[i] == ref_lse[i];
    if (!both_inf && !(std::abs(lse[i] - ref_lse[i]) <= 1e-4 * (1 + std::abs(ref_lse[i]))) &&
        ++failures <= 3) {
      ADD_FAILURE() << where << ": lse[" << i << "] = " << lse[i] << " vs " << ref_lse[i];
    }
  }
  return failures;
}

}  // namespace flashserve::kvcache::testing
