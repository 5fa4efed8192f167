// The tiled online-softmax attention body, written once against a SIMD traits struct S.
// Included only by attention_tile_<isa>.cc, each of which defines FLASHSERVE_TILE_TARGET (the
// function attribute that selects its instruction set) and its traits first. Everything here has
// internal linkage, so every ISA gets its own copy and no instantiation leaks into portable code.
//
// Traits S provide: V (vector of kWidth floats); zero, set1, load, store, add, sub, mul, fmadd
// (a*b+c), max (returns the second operand when either is NaN), exp2 (for x <= 0, exactly 0 at
// -inf, NaN in -> NaN out), zero_if_neg_inf; convert_in / convert_out (dtype <-> float rows);
// the register-block shape kScoreKeys x kScoreVecs (S^T = K Q^T) and kOutRows x kOutVecs (O += P
// V).
//
// Layout of one query block (block_q = 64 rows, key tiles of 64):
//   qt [head_dim][64]   Q^T in fp32, converted once per block
//   k  [64 + pad][head_dim], v [64][dv]   the current key/value tile in fp32, converted once per
//   tile st [64 + pad keys][64 queries] scores, then probabilities (keys x queries, so the softmax
//   runs
//                              down columns with vertical max/sum and no horizontal reductions)
//   o  [64][dv]   unnormalized fp32 output accumulator (dv = head_dim rounded up to kWidth)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/float_convert.h"
#include "tile_kernel.h"

namespace flashserve::kernels::cpu {
namespace {

constexpr int kBlockQ = 64;  // query rows per task; also the leading dimension of qt and st
constexpr int kBlockK = 64;  // keys per tile: st (16 KiB) and a d=128 V tile (32 KiB) stay in L1/L2

constexpr size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

template <class S>
struct Workspace {
  static constexpr int kKeyRows = static_cast<int>(round_up(kBlockK, S::kScoreKeys));
  size_t qt, k, v, st, o, row, total;  // float offsets, each 64-byte aligned

  explicit Workspace(int head_dim) {
    const size_t d = head_dim, dv = round_up(head_dim, S::kWidth);
    size_t at = 0;
    auto take = [&at](size_t floats) {
      const size_t offset = at;
      at += round_up(floats, 16);
      return offset;
    };
    qt = take(d * kBlockQ);
    k = take(size_t{kKeyRows} * d);
    v = take(kBlockK * dv);
    st = take(size_t{kKeyRows} * kBlockQ);  // rows past kBlockK catch the padded key group
    o = take(kBlockQ * dv);
    row = take(dv);
    total = at;
  }
};

template <class S>
size_t workspace_floats(int head_dim) {
  return Workspace<S>(head_dim).total;
}

// st[r][0 : C*W] = K rows [r] . Q^T columns, for kScoreKeys key rows and C query vectors.
template <class S, int C>
FLASHSERVE_TILE_TARGET inline void score_block(const float* k, int d, const float* qt, float* st) {
  using V = typename S::V;
  constexpr int R = S::kScoreKeys, W = S::kWidth;
  V acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = S::zero();
  for (int x = 0; x < d; ++x) {
    V q[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) q[c] = S::load(qt + x * kBlockQ + c * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V kb = S::set1(k[r * d + x]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = S::fmadd(kb, q[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) S::store(st + r * kBlockQ + c * W, acc[r][c]);
}

// Picks the score_block instantiation for the last, partial group of query vectors.
template <class S, int C>
FLASHSERVE_TILE_TARGET inline void score_block_n(int n, const float* k, int d, const float* qt,
                                                 float* st) {
  if constexpr (C > 0) {
    if (n == C) return score_block<S, C>(k, d, qt, st);
    score_block_n<S, C - 1>(n, k, d, qt, st);
  }
}

// o rows [0, R), vectors [0, C): o = o * alpha + P V over the keys each row sees (lim[r]).
// Keys a row may not see are skipped, not multiplied by a zero probability, so a NaN or Inf in a
// masked V row cannot leak into that row.
template <class S, int R, int C>
FLASHSERVE_TILE_TARGET inline void pv_block(const float* pt, const float* v, int dv,
                                            const float* alpha, const int* lim, float* o) {
  using V = typename S::V;
  constexpr int W = S::kWidth;
  V acc[R][C];
  int j_all = lim[0], j_any = lim[0];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    j_all = std::min(j_all, lim[r]);
    j_any = std::max(j_any, lim[r]);
    const V a = S::set1(alpha[r]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = S::mul(S::load(o + r * dv + c * W), a);
  }
  for (int j = 0; j < j_all; ++j) {
    V vv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) vv[c] = S::load(v + j * dv + c * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V pb = S::set1(pt[j * kBlockQ + r]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = S::fmadd(pb, vv[c], acc[r][c]);
    }
  }
  for (int j = j_all; j < j_any; ++j) {  // causal diagonal: rows see different key counts
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (j >= lim[r]) continue;
      const V pb = S::set1(pt[j * kBlockQ + r]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = S::fmadd(pb, S::load(v + j * dv + c * W), acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) S::store(o + r * dv + c * W, acc[r][c]);
}

template <class S, int C>
FLASHSERVE_TILE_TARGET inline void pv_block_n(int n, const float* pt, const float* v, int dv,
                                              const float* alpha, const int* lim, float* o) {
  if constexpr (C > 0) {
    if (n == C) return pv_block<S, S::kOutRows, C>(pt, v, dv, alpha, lim, o);
    pv_block_n<S, C - 1>(n, pt, v, dv, alpha, lim, o);
  }
}

template <class S>
FLASHSERVE_TILE_TARGET bool run_block(const AttentionParams& p, int b, int h, int q0, int nq,
                                      float* ws_base, StopSignal* stop) {
  using V = typename S::V;
  constexpr int W = S::kWidth;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const Workspace<S> ws(p.head_dim);
  const int d = p.head_dim;
  const int dv = static_cast<int>(round_up(d, W));
  const int nq_pad = static_cast<int>(round_up(nq, std::max(W, S::kOutRows)));
  const int q_vecs = nq_pad / W;
  const int d_vecs = dv / W;
  const size_t esize = dtype_size(p.dtype);
  const int hk = h / (p.heads_q / p.heads_kv);
  const int offset = p.seqlen_k - p.seqlen_q;  // query i sees keys j <= i + offset
  const float scale_log2 = static_cast<float>(double(p.softmax_scale) * 1.4426950408889634);

  float* qt = ws_base + ws.qt;
  float* kt = ws_base + ws.k;
  float* vt = ws_base + ws.v;
  float* st = ws_base + ws.st;
  float* o = ws_base + ws.o;
  float* row = ws_base + ws.row;
  alignas(64) float m[kBlockQ];      // running max of the scaled scores (log2 domain)
  alignas(64) float l[kBlockQ];      // running sum of exp2(score - m)
  alignas(64) float alpha[kBlockQ];  // rescale factor of o for the current tile
  alignas(64) int lim[kBlockQ];      // keys of the current tile that each row sees

  // Q^T, zero-padded to nq_pad columns.
  std::memset(qt, 0, sizeof(float) * size_t(d) * kBlockQ);
  const char* q_base =
      static_cast<const char*>(p.q) +
      (b * p.q_batch_stride + h * p.q_head_stride + int64_t{q0} * p.q_row_stride) * esize;
  for (int i = 0; i < nq; ++i) {
    S::convert_in(q_base + i * p.q_row_stride * int64_t(esize), p.dtype, row, d);
    for (int x = 0; x < d; ++x) qt[x * kBlockQ + i] = row[x];
  }
  std::memset(o, 0, sizeof(float) * size_t(nq_pad) * dv);
  for (int i = 0; i < nq_pad; ++i) {
    m[i] = kNegInf;
    l[i] = 0.f;
  }
  std::memset(kt, 0, sizeof(float) * size_t(Workspace<S>::kKeyRows) * d);  // key padding rows
  std::memset(vt, 0, sizeof(float) * size_t(kBlockK) * dv);                // head_dim padding

  const char* k_base =
      static_cast<const char*>(p.k) + (b * p.k_batch_stride + hk * p.k_head_stride) * esize;
  const char* v_base =
      static_cast<const char*>(p.v) + (b * p.v_batch_stride + hk * p.v_head_stride) * esize;
  // Keys past the block's last visible one are never loaded.
  const int k_end = p.causal ? std::clamp(q0 + nq + offset, 0, p.seqlen_k) : p.seqlen_k;

  for (int j0 = 0; j0 < k_end; j0 += kBlockK) {
    // A tile is microseconds of work (64 x 64 x head_dim), so a stopped request leaves at once
    // even when one block sees millions of keys.
    if (stop != nullptr && stop->stop_requested()) return false;
    const int nk = std::min(kBlockK, k_end - j0);
    for (int j = 0; j < nk; ++j) {
      S::convert_in(k_base + (j0 + j) * p.k_row_stride * int64_t(esize), p.dtype, kt + j * d, d);
      S::convert_in(v_base + (j0 + j) * p.v_row_stride * int64_t(esize), p.dtype, vt + j * dv, d);
    }
    // Scores S^T = K Q^T (rows past nk hold zeros or stale keys and are never read).
    const int nk_pad = static_cast<int>(round_up(nk, S::kScoreKeys));
    for (int j = 0; j < nk_pad; j += S::kScoreKeys) {
      for (int c = 0; c < q_vecs; c += S::kScoreVecs) {
        score_block_n<S, S::kScoreVecs>(std::min(S::kScoreVecs, q_vecs - c), kt + j * d, d,
                                        qt + c * W, st + j * kBlockQ + c * W);
      }
    }
    // Causal mask: key j of the tile is hidden from local query rows i < j0 + j - q0 - offset.
    for (int i = 0; i < nq_pad; ++i) {
      lim[i] = p.causal ? std::clamp(q0 + i + offset + 1 - j0, 0, nk) : nk;
    }
    if (p.causal) {
      for (int j = 0; j < nk; ++j) {
        const int hidden = std::clamp(j0 + j - q0 - offset, 0, nq_pad);
        std::fill(st + j * kBlockQ, st + j * kBlockQ + hidden, kNegInf);
      }
    }
    // Online softmax down each query column, W queries at a time.
    const V scale = S::set1(scale_log2);
    for (int c = 0; c < q_vecs; ++c) {
      float* col = st + c * W;
      const V m_old = S::load(m + c * W);
      V m_new = m_old;
      for (int j = 0; j < nk; ++j) {
        const V s = S::mul(S::load(col + j * kBlockQ), scale);
        S::store(col + j * kBlockQ, s);
        m_new = S::max(m_new, s);
      }
      // A column that has seen only -inf subtracts 0 instead, so its probabilities are 0, not NaN.
      const V m_sub = S::zero_if_neg_inf(m_new);
      V sum = S::zero();
      for (int j = 0; j < nk; ++j) {
        const V prob = S::exp2(S::sub(S::load(col + j * kBlockQ), m_sub));
        S::store(col + j * kBlockQ, prob);
        sum = S::add(sum, prob);
      }
      const V a = S::exp2(S::sub(m_old, m_sub));
      S::store(alpha + c * W, a);
      S::store(l + c * W, S::fmadd(S::load(l + c * W), a, sum));
      S::store(m + c * W, m_new);
    }
    // O = O * alpha + P V.
    for (int r = 0; r < nq_pad; r += S::kOutRows) {
      for (int c = 0; c < d_vecs; c += S::kOutVecs) {
        pv_block_n<S, S::kOutVecs>(std::min(S::kOutVecs, d_vecs - c), st + r, vt + c * W, dv,
                                   alpha + r, lim + r, o + r * dv + c * W);
      }
    }
  }

  // O / l in p.dtype; a row that saw no key (l == 0) gets O = 0 and LSE = -inf.
  char* o_base =
      static_cast<char*>(p.o) +
      (b * p.o_batch_stride + h * p.o_head_stride + int64_t{q0} * p.o_row_stride) * esize;
  float* lse = p.lse ? p.lse + (int64_t{b} * p.heads_q + h) * p.seqlen_q + q0 : nullptr;
  for (int i = 0; i < nq; ++i) {
    const bool empty = l[i] == 0.f;
    for (int x = 0; x < d; ++x) row[x] = empty ? 0.f : o[i * dv + x] / l[i];
    S::convert_out(row, d, o_base + i * p.o_row_stride * int64_t(esize), p.dtype);
    if (lse) {
      lse[i] = empty
                   ? kNegInf
                   : static_cast<float>(double(m[i]) * 0.6931471805599453 + std::log(double(l[i])));
    }
  }
  return true;
}

}  // namespace
}  // namespace flashserve::kernels::cpu
