// Naive attention references (test-only): exact fp64, and an emulation of a fp32-accumulating
// FlashAttention-style kernel in p.dtype (optionally with the kernel's key blocks, their order
// and its rescale rule). Straight loops over the definition; no threads.
#include "flashserve/kernels/reference_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "flashserve/kernels/float_convert.h"

namespace flashserve::kernels::reference {
namespace {

// Number of keys query row i may attend (keys [0, n) are visible).
int visible_keys(const AttentionParams& p, int i) {
  if (!p.causal) return p.seqlen_k;
  const int64_t last = int64_t{i} + p.seqlen_k - p.seqlen_q;  // last visible key index
  return static_cast<int>(std::clamp<int64_t>(last + 1, 0, p.seqlen_k));
}

// One (batch, head)'s rows of Q, K or V as float (inputs are exact in float for every dtype).
std::vector<float> gather(const void* base, int64_t batch_offset, int64_t row_stride, int rows,
                          int head_dim, DType dtype) {
  std::vector<float> out(size_t(rows) * head_dim);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < head_dim; ++c) {
      out[size_t(r) * head_dim + c] = load_element(base, batch_offset + r * row_stride + c, dtype);
    }
  }
  return out;
}

// Calls row_fn(b, h, i, q_row, k, v, out_row, lse) for every query row, with K/V of the matching
// key/value head gathered once per (b, h).
template <class RowFn>
void for_each_row(const AttentionParams& p, std::vector<double>* out, std::vector<double>* lse,
                  RowFn row_fn) {
  const int d = p.head_dim;
  out->assign(size_t(p.batch) * p.seqlen_q * p.heads_q * d, 0.0);
  lse->assign(size_t(p.batch) * p.heads_q * p.seqlen_q, 0.0);
  const int group = p.heads_q / p.heads_kv;
  for (int b = 0; b < p.batch; ++b) {
    for (int h = 0; h < p.heads_q; ++h) {
      const int hk = h / group;
      const std::vector<float> q = gather(p.q, b * p.q_batch_stride + h * p.q_head_stride,
                                          p.q_row_stride, p.seqlen_q, d, p.dtype);
      const std::vector<float> k = gather(p.k, b * p.k_batch_stride + hk * p.k_head_stride,
                                          p.k_row_stride, p.seqlen_k, d, p.dtype);
      const std::vector<float> v = gather(p.v, b * p.v_batch_stride + hk * p.v_head_stride,
                                          p.v_row_stride, p.seqlen_k, d, p.dtype);
      for (int i = 0; i < p.seqlen_q; ++i) {
        double* o_row = out->data() + ((size_t(b) * p.seqlen_q + i) * p.heads_q + h) * d;
        double* lse_row = lse->data() + (size_t(b) * p.heads_q + h) * p.seqlen_q + i;
        row_fn(visible_keys(p, i), q.data() + size_t(i) * d, k, v, o_row, lse_row);
      }
    }
  }
}

}  // namespace

void attention_fp64(const AttentionParams& p, std::vector<double>* out, std::vector<double>* lse) {
  const int d = p.head_dim;
  std::vector<double> s(p.seqlen_k);
  for_each_row(p, out, lse,
               [&](int n, const float* q, const std::vector<float>& k, const std::vector<float>& v,
                   double* o, double* lse_out) {
                 if (n == 0) {  // no visible key: O = 0 (already), LSE = -inf
                   *lse_out = -std::numeric_limits<double>::infinity();
                   return;
                 }
                 double m = -std::numeric_limits<double>::infinity();
                 bool any_nan = false;
                 for (int j = 0; j < n; ++j) {
                   double dot = 0;
                   for (int c = 0; c < d; ++c) dot += double(q[c]) * double(k[size_t(j) * d + c]);
                   s[j] = dot * double(p.softmax_scale);
                   any_nan |= std::isnan(s[j]);
                   m = std::max(m, s[j]);
                 }
                 if (any_nan) m = std::numeric_limits<double>::quiet_NaN();
                 double l = 0;
                 for (int j = 0; j < n; ++j) {
                   s[j] = std::exp(s[j] - m);
                   l += s[j];
                 }
                 for (int j = 0; j < n; ++j) {
                   const double w = s[j] / l;
                   for (int c = 0; c < d; ++c) o[c] += w * double(v[size_t(j) * d + c]);
                 }
                 *lse_out = m + std::log(l);
               });
}

void attention_emulated(const AttentionParams& p, std::vector<double>* out,
                        std::vector<double>* lse) {
  attention_emulated(p, EmulationOptions{}, out, lse);
}

void attention_emulated(const AttentionParams& p, const EmulationOptions& options,
                        std::vector<double>* out, std::vector<double>* lse) {
  const int d = p.head_dim;
  // exp2-based softmax in the log2 domain, as FlashAttention-2 kernels do.
  const float scale_log2 = static_cast<float>(double(p.softmax_scale) * 1.4426950408889634);
  const int block_n = options.block_n;
  const float threshold = options.rescale_threshold_log2;
  std::vector<float> s(p.seqlen_k);
  std::vector<float> acc(d);
  for_each_row(p, out, lse,
               [&](int n, const float* q, const std::vector<float>& k, const std::vector<float>& v,
                   double* o, double* lse_out) {
                 if (n == 0) {
                   *lse_out = -std::numeric_limits<double>::infinity();
                   return;
                 }
                 float m = -std::numeric_limits<float>::infinity();
                 bool any_nan = false;
                 for (int j = 0; j < n; ++j) {
                   float dot = 0.f;
                   for (int c = 0; c < d; ++c) dot = std::fma(q[c], k[size_t(j) * d + c], dot);
                   s[j] = dot * scale_log2;
                   any_nan |= std::isnan(s[j]);
                   m = std::max(m, s[j]);
                 }
                 if (any_nan) m = std::numeric_limits<float>::quiet_NaN();
                 float l = 0.f;  // row sum of the unrounded fp32 probabilities
                 std::fill(acc.begin(), acc.end(), 0.f);
                 // P = 2^(s - m) rounded to p.dtype (it enters P @ V in p.dtype) for keys [j0, j1).
                 auto accumulate = [&](int j0, int j1) {
                   for (int j = j0; j < j1; ++j) {
                     const float prob = std::exp2(s[j] - m);
                     l += prob;
                     const float prob_rounded = round_to_dtype(prob, p.dtype);
                     for (int c = 0; c < d; ++c)
                       acc[c] = std::fma(prob_rounded, v[size_t(j) * d + c], acc[c]);
                   }
                 };
                 if (block_n <= 0 || any_nan) {
                   accumulate(0, n);  // every P against the final max
                 } else {
                   // The kernel's online softmax: blocks in its order (only those with a visible
                   // key: the others change nothing), the running max moving only by more than
                   // the threshold, O and l rescaled in fp32 when it moves.
                   const int blocks = (n + block_n - 1) / block_n;
                   m = -std::numeric_limits<float>::infinity();
                   for (int t = 0; t < blocks; ++t) {
                     const int blk = options.backwards ? blocks - 1 - t : t;
                     const int j0 = blk * block_n, j1 = std::min(n, j0 + block_n);
                     float block_max = m;
                     for (int j = j0; j < j1; ++j) block_max = std::max(block_max, s[j]);
                     if (block_max - m > threshold) {  // always true for the first block (m = -inf)
                       const float alpha = std::exp2(m - block_max);
                       l *= alpha;
                       for (int c = 0; c < d; ++c) acc[c] *= alpha;
                       m = block_max;
                     }
                     accumulate(j0, j1);
                   }
                 }
                 for (int c = 0; c < d; ++c) o[c] = round_to_dtype(acc[c] / l, p.dtype);
                 *lse_out = double(m) * 0.6931471805599453 + std::log(double(l));
               });
}

}  // namespace flashserve::kernels::reference
