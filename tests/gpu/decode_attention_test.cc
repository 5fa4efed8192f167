// Correctness of the split-KV decode kernels (kernels/cuda/decode) against fp64 and
// dtype-emulating CPU references, on fresh random inputs: dense, dense varlen and paged K/V
// (odd page sizes, shuffled pages, sequences ending mid-page, empty sequences, huge block
// tables), Sq 1..16 with causal, GQA groups 1..16, forced and heuristic split counts; at d64 both
// key tile widths of the 16-row kernel (64 keys, and 128 on 2 or 3 stages: DecodeAttentionWide).
// Unused page-pool rows and unused block-table entries are poisoned (NaN rows, out-of-range page
// ids), so reading past a sequence shows up as NaN output or a sanitizer error; outputs are
// NaN-poisoned before every run. Tolerance: the kernel's error against fp64 may be at most twice
// that of the worse of two same-precision emulations (P rounded against the final row max, and
// against a running max over 16-key blocks, as one warp of the kernel does), as in
// cuda_attention_test.cc.
#include "flashserve/kernels/decode_attention.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../../kernels/cuda/counter_slots.h"  // last_counter_slot (internal)
#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/reference_attention.h"
#include "flashserve/kernels/tuner.h"
#include "gpu_test_support.h"

namespace flashserve::kernels::cuda::decode {
int& l2_prefetch_override();  // kernels/cuda/decode/decode_dispatch.cu (benchmarking knobs)
int& copy_override();
int& pdl_override();
int& deep_issue_override();
int& last_copy();
int& tma_wide_override();
int& wide_tiles_override();
int& last_block_n();
int& last_stages();
int& fused_merge_override();  // kernels/cuda/decode/decode_merge_plan.cu
int& last_merge();
}  // namespace flashserve::kernels::cuda::decode

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

enum class Layout { kDense, kDenseVarlen, kPaged };

struct DecodeCase {
  std::string tag;       // part of the test name ("san" marks the sanitizer's subset)
  Layout layout;
  std::vector<int> sq;   // per sequence (kDense and fixed paged: all equal)
  std::vector<int> sk;   // per sequence (kDense: all equal)
  int heads_q, heads_kv, head_dim;
  bool causal;
  int page_size = 0;         // kPaged
  bool varlen_q = false;     // kPaged: cu_seqlens_q instead of a fixed seqlen_q
  int extra_table = 0;       // kPaged: unused block-table entries per sequence
  float input_scale = 1.f;   // > 1: large logits
  DType dtype = DType::kBFloat16;
};

std::string case_name(const DecodeCase& c) {
  const char* layout = c.layout == Layout::kDense ? "dense"
                       : c.layout == Layout::kDenseVarlen ? "varlen" : "paged";
  return c.tag + "_" + layout + "_" + (c.dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" +
         std::to_string(c.head_dim) + "_h" + std::to_string(c.heads_q) + "x" +
         std::to_string(c.heads_kv) + (c.causal ? "_causal" : "") +
         (c.page_size ? "_p" + std::to_string(c.page_size) : "");
}

// Host copy of one problem: per-sequence dense Q/K/V (for the references) and the kernel's
// layout of the same values.
struct HostProblem {
  int batch = 0, total_q = 0, max_sq = 0, max_sk = 0;
  std::vector<int> q_start, k_start;               // prefix sums of sq, sk
  std::vector<std::vector<uint16_t>> q, k, v;      // per sequence [S, heads, d]
  std::vector<uint16_t> q_all;                     // [total_q, heads_q, d]
  std::vector<uint16_t> k_all, v_all;              // dense [B, max_sk, ..] / packed / page pool
  std::vector<int32_t> block_table;                // paged
  int table_stride = 0, num_pages = 0;
};

// Fills the page pool with poison, then places each sequence's keys in shuffled pages.
void build_paged(const DecodeCase& c, std::mt19937_64& rng, HostProblem* hp) {
  const int hkv = c.heads_kv, d = c.head_dim, ps = c.page_size;
  std::vector<int> pages_of(hp->batch);
  int needed = 0;
  for (int b = 0; b < hp->batch; ++b) needed += pages_of[b] = (c.sk[b] + ps - 1) / ps;
  hp->num_pages = needed + 3;  // three pages no sequence owns
  hp->table_stride = std::max(1, *std::max_element(pages_of.begin(), pages_of.end())) + c.extra_table;
  std::vector<int> order(hp->num_pages);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  const size_t page_elems = size_t(ps) * hkv * d;
  hp->k_all.assign(hp->num_pages * page_elems, 0xFFFF);  // the poison: NaN in fp16 and bf16
  hp->v_all.assign(hp->num_pages * page_elems, 0xFFFF);
  // Unused entries hold page ids far out of range: a read through one faults under the sanitizer.
  hp->block_table.assign(size_t(hp->batch) * hp->table_stride, 1 << 28);
  int next = 0;
  for (int b = 0; b < hp->batch; ++b)
    for (int pg = 0; pg < pages_of[b]; ++pg) {
      const int page = order[next++];
      hp->block_table[size_t(b) * hp->table_stride + pg] = page;
      for (int r = 0; r < ps && pg * ps + r < c.sk[b]; ++r) {
        const size_t src = size_t(pg * ps + r) * hkv * d;
        const size_t dst = page * page_elems + size_t(r) * hkv * d;
        std::copy_n(hp->k[b].begin() + src, size_t(hkv) * d, hp->k_all.begin() + dst);
        std::copy_n(hp->v[b].begin() + src, size_t(hkv) * d, hp->v_all.begin() + dst);
      }
    }
}

HostProblem make_problem(const DecodeCase& c, std::mt19937_64& rng) {
  HostProblem hp;
  hp.batch = static_cast<int>(c.sq.size());
  const int hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
  auto random = [&](size_t n, float scale) { return tu::random_tensor(c.dtype, n, scale, rng); };
  for (int b = 0; b < hp.batch; ++b) {
    hp.q_start.push_back(hp.total_q);
    hp.k_start.push_back(b == 0 ? 0 : hp.k_start.back() + c.sk[b - 1]);
    hp.total_q += c.sq[b];
    hp.max_sq = std::max(hp.max_sq, c.sq[b]);
    hp.max_sk = std::max(hp.max_sk, c.sk[b]);
    hp.q.push_back(random(size_t(c.sq[b]) * hq * d, c.input_scale));
    hp.k.push_back(random(size_t(c.sk[b]) * hkv * d, c.input_scale));
    hp.v.push_back(random(size_t(c.sk[b]) * hkv * d, 1.f));
    hp.q_all.insert(hp.q_all.end(), hp.q[b].begin(), hp.q[b].end());
  }
  if (c.layout == Layout::kPaged) {
    build_paged(c, rng, &hp);
  } else {  // dense: [B, max_sk] (all equal) or packed varlen: the same concatenation
    for (int b = 0; b < hp.batch; ++b) {
      hp.k_all.insert(hp.k_all.end(), hp.k[b].begin(), hp.k[b].end());
      hp.v_all.insert(hp.v_all.end(), hp.v[b].begin(), hp.v[b].end());
    }
  }
  return hp;
}

// References in the kernel's output layout: out [total_q, heads_q, d]; LSE fixed
// [B, heads_q, sq] or varlen [heads_q, total_q].
struct References {
  std::vector<double> out, lse;
  std::vector<std::vector<double>> emu_out, emu_lse;  // per emulation
};

References compute_references(const DecodeCase& c, const HostProblem& hp, bool varlen_lse) {
  const int hq = c.heads_q, d = c.head_dim;
  References r;
  r.out.assign(size_t(hp.total_q) * hq * d, 0.0);
  r.lse.assign(size_t(hp.total_q) * hq, 0.0);
  std::vector<reference::EmulationOptions> emulations(2);
  emulations[1].block_n = 16;
  emulations[1].backwards = false;
  r.emu_out.assign(2, r.out);
  r.emu_lse.assign(2, r.lse);
  auto place = [&](int b, const std::vector<double>& o, const std::vector<double>& l,
                   std::vector<double>* out, std::vector<double>* lse) {
    std::copy(o.begin(), o.end(), out->begin() + size_t(hp.q_start[b]) * hq * d);
    for (int h = 0; h < hq; ++h)
      for (int i = 0; i < c.sq[b]; ++i) {
        const size_t at = varlen_lse ? size_t(h) * hp.total_q + hp.q_start[b] + i
                                     : (size_t(b) * hq + h) * c.sq[b] + i;
        (*lse)[at] = l[size_t(h) * c.sq[b] + i];
      }
  };
  for (int b = 0; b < hp.batch; ++b) {
    if (c.sq[b] == 0) continue;
    AttentionParams p = make_contiguous_params(c.dtype, 1, c.sq[b], c.sk[b], hq, c.heads_kv, d,
                                               c.causal, 1.f / std::sqrt(float(d)));
    static const uint16_t kNone[1] = {0};
    p.q = hp.q[b].data();
    p.k = c.sk[b] ? hp.k[b].data() : kNone;
    p.v = c.sk[b] ? hp.v[b].data() : kNone;
    std::vector<double> o, l;
    reference::attention_fp64(p, &o, &l);
    place(b, o, l, &r.out, &r.lse);
    for (size_t e = 0; e < emulations.size(); ++e) {
      reference::attention_emulated(p, emulations[e], &o, &l);
      place(b, o, l, &r.emu_out[e], &r.emu_lse[e]);
    }
  }
  return r;
}

// Device copies of a problem and the DecodeParams pointing at them.
struct DeviceProblem {
  tu::DeviceBuffer q, k, v, o, lse, cu_q, cu_k, seqlens_k, table;
  fk::DecodeParams p;
  size_t out_elems, lse_elems;

  DeviceProblem(const DecodeCase& c, const HostProblem& hp)
      : q(hp.q_all.size() * 2), k(hp.k_all.size() * 2), v(hp.v_all.size() * 2),
        o(hp.q_all.size() * 2), lse(size_t(hp.total_q) * c.heads_q * 4),
        cu_q((hp.batch + 1) * 4), cu_k((hp.batch + 1) * 4), seqlens_k(hp.batch * 4),
        table(std::max<size_t>(hp.block_table.size(), 1) * 4) {
    out_elems = hp.q_all.size();
    lse_elems = size_t(hp.total_q) * c.heads_q;
    EXPECT_EQ(q.upload(hp.q_all), cudaSuccess);
    EXPECT_EQ(k.upload(hp.k_all), cudaSuccess);
    EXPECT_EQ(v.upload(hp.v_all), cudaSuccess);
    std::vector<int32_t> cu_q_h{0}, cu_k_h{0}, sk_h(c.sk.begin(), c.sk.end());
    for (int b = 0; b < hp.batch; ++b) {
      cu_q_h.push_back(cu_q_h.back() + c.sq[b]);
      cu_k_h.push_back(cu_k_h.back() + c.sk[b]);
    }
    EXPECT_EQ(cu_q.upload(cu_q_h), cudaSuccess);
    EXPECT_EQ(cu_k.upload(cu_k_h), cudaSuccess);
    EXPECT_EQ(seqlens_k.upload(sk_h), cudaSuccess);
    if (!hp.block_table.empty()) {
      EXPECT_EQ(table.upload(hp.block_table), cudaSuccess);
    }

    const int hq = c.heads_q, hkv = c.heads_kv, d = c.head_dim;
    p = fk::make_dense_decode_params(c.dtype, hp.batch, hp.max_sq, hp.max_sk, hq, hkv, d,
                                     c.causal, 1.f / std::sqrt(float(d)));
    p.q = q.get(), p.k = k.get(), p.v = v.get(), p.o = o.get();
    p.lse = lse.as<float>();
    const bool varlen_q = c.layout == Layout::kDenseVarlen || c.varlen_q;
    if (varlen_q) {
      p.cu_seqlens_q = cu_q.as<const int32_t>();
      p.total_q = hp.total_q;
    }
    if (c.layout == Layout::kDenseVarlen) p.cu_seqlens_k = cu_k.as<const int32_t>();
    if (c.layout == Layout::kPaged) {
      p.seqlens_k = seqlens_k.as<const int32_t>();
      p.block_table = table.as<const int32_t>();
      p.block_table_stride = hp.table_stride;
      p.page_size = c.page_size;
      p.k_batch_stride = p.v_batch_stride = int64_t{c.page_size} * hkv * d;
    }
  }
};

bool uses_varlen_lse(const DecodeCase& c) {
  return c.layout == Layout::kDenseVarlen || c.varlen_q;
}

// Keys per tile and stages of the kernel run_decode must pick for c (parameters p, `splits`
// splits, 0: the heuristic's) with the knobs as set, restated from select_kernel / wide_stages
// (decode_dispatch.cu): 32 above 32 packed rows (group x Sq), else 64, except 128 for d64 with
// <= 16 rows (wide_tiles_override 1, 2, 3: always; -1: unless the key axis is split and the pages
// are < 64 keys; 0: never). Stages of the 128-key kernel: the knob's 2 or 3, else 3 unsplit, 2
// for splits of >= 4096 keys, else 3.
struct ExpectedTiles {
  int block_n = 64;
  int stages = 0;  // 128-key kernels only
};
ExpectedTiles expected_tiles(const DecodeCase& c, const fk::DecodeParams& p, int splits) {
  int max_sq = 0;
  for (int sq : c.sq) max_sq = std::max(max_sq, sq);
  const int rows = (c.heads_q / c.heads_kv) * std::max(max_sq, 1);
  if (rows > 32) return {32, 0};
  const int knob = fk::decode::wide_tiles_override();
  if (c.head_dim != 64 || rows > 16 || knob == 0) return {64, 0};
  if (knob == 2 || knob == 3) return {128, knob};
  int sms = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int used = splits > 0 ? splits : fk::decode_num_splits(p, sms);
  if (used == 1) return {128, 3};
  if (knob < 0 && c.layout == Layout::kPaged && c.page_size < 64) return {64, 0};
  return {128, p.seqlen_k / used >= 4096 ? 2 : 3};
}

// Whether the TMA copy (knob 2, the default) must really run for c, restated from its documented
// limits (decode_tensor_map.h): sm_90+, head_dim a multiple of 32 (slices of 64 columns, or 32 at
// d32 / d96), no packed varlen K/V, power-of-two pages >= 8 with at most 32 boxes per key tile.
// Otherwise it falls back to cp.async. 32-column slices exist in the 16-row kernels only
// (DecodeTraits::kHasTma), and by default (forced false) run at d32 on dense K/V or pages >= 64
// only (decode_dispatch.cu, default_copy_sm90).
bool expects_tma(const DecodeCase& c, int block_n, bool forced) {
  if (c.head_dim % 64 != 0) {
    int max_sq = 0;
    for (int sq : c.sq) max_sq = std::max(max_sq, sq);
    if ((c.heads_q / c.heads_kv) * std::max(max_sq, 1) > 16) return false;
    if (!forced && c.head_dim == 32 && c.layout == Layout::kPaged && c.page_size < 64) return false;
  }
  if (tu::device_compute_major() < 9 || c.head_dim % 32 != 0 || c.layout == Layout::kDenseVarlen)
    return false;
  if (c.layout == Layout::kDense) return true;
  const int ps = c.page_size;
  if (ps < 8 || (ps & (ps - 1)) != 0) return false;
  const int slices = c.head_dim % 64 == 0 ? c.head_dim / 64 : c.head_dim / 32;
  return 2 * slices * (block_n / std::min(ps, block_n)) <= 32;
}

const char* const kVariantNames[] = {
    "cp.async, combine kernel", "TMA, deep order, wide boxes on even split counts, combine kernel",
    "cp.async + PDL, in-kernel merge", "default"};

// The yardstick: the worse of the two emulations' errors against fp64, output and LSE.
tu::EmulatedError worst_emulation(const References& ref) {
  tu::EmulatedError worst;
  for (size_t e = 0; e < ref.emu_out.size(); ++e) {
    const tu::ErrorStats s = tu::error_vs(ref.emu_out[e], ref.out);
    worst.out.max_abs = std::max(worst.out.max_abs, s.max_abs);
    worst.out.rel_l2 = std::max(worst.out.rel_l2, s.rel_l2);
    worst.lse = std::max(worst.lse, tu::lse_error(ref.emu_lse[e], ref.lse));
  }
  return worst;
}

// Sets the benchmarking knobs for variant (0: cp.async, no PDL, combine kernel; 1: TMA, deep
// order, wide boxes on even split counts, combine kernel; 2: cp.async + PDL, in-kernel merge
// wherever shared memory holds the partials, past the default's size limit; 3: the defaults).
void set_variant(int variant, int splits) {
  fk::decode::fused_merge_override() = variant <= 1 ? 0 : variant == 2 ? 2 : -1;
  fk::decode::copy_override() = variant == 1 ? 2 : variant == 3 ? -1 : 0;
  fk::decode::pdl_override() = variant == 0 ? 0 : variant == 2 ? 1 : -1;
  fk::decode::deep_issue_override() = variant == 1 || variant == 2 ? 1 : variant == 0 ? 0 : -1;
  fk::decode::tma_wide_override() = variant == 1 ? 1 - splits % 2 : -1;
}

// Puts the knobs back to their defaults when a case ends, however it ends.
struct DefaultKnobsAfter {
  ~DefaultKnobsAfter() { set_variant(3, 0); }
};

// One launch with `splits` splits and the knobs as set; O widened to double.
void run_once(const DecodeCase& c, DeviceProblem& dev, int splits, tu::RunAnswers* answers) {
  fk::DecodeParams p = dev.p;
  p.num_splits = splits;
  ASSERT_EQ(dev.o.poison(), cudaSuccess);
  ASSERT_EQ(dev.lse.poison(), cudaSuccess);
  ASSERT_EQ(fk::run_decode(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(dev.out_elems);
  answers->lse.resize(dev.lse_elems);
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  ASSERT_EQ(dev.lse.download(&answers->lse), cudaSuccess);
  answers->out = tu::to_double(c.dtype, out);
}

// One launch of the (poisoned) problem with the knobs as set, checked against the references.
void check_run(const DecodeCase& c, const HostProblem& hp, DeviceProblem& dev,
               const References& ref, const tu::EmulatedError& emu, int splits, int variant) {
  tu::RunAnswers got;
  ASSERT_NO_FATAL_FAILURE(run_once(c, dev, splits, &got));
  fk::DecodeParams p = dev.p;
  p.num_splits = splits;
  const ExpectedTiles want = expected_tiles(c, p, splits);
  if (variant % 2 == 1 && hp.total_q > 0) {
    ASSERT_EQ(fk::decode::last_copy(), expects_tma(c, want.block_n, variant == 1) ? 2 : 0)
        << "TMA path taken or not";
  }
  if (variant <= 1) {
    ASSERT_NE(fk::decode::last_merge(), 2) << "the combine kernel was asked for";
  }
  if (hp.total_q > 0) {
    ASSERT_EQ(fk::decode::last_block_n(), want.block_n) << "keys per tile";
    if (want.block_n == 128) {
      ASSERT_EQ(fk::decode::last_stages(), want.stages) << "stages";
    }
  }
  ASSERT_TRUE(tu::all_finite(got.out));
  EXPECT_TRUE(tu::lse_matches(got.lse, ref.lse, emu.lse));
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(got.out, ref.out), emu.out));
}

// Runs the case with the heuristic's split count and with forced ones; checks each result.
void check_case(const DecodeCase& c) {
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  DeviceProblem dev(c, hp);
  ASSERT_EQ(fk::decode_supported(dev.p), "");
  const DefaultKnobsAfter restore;
  // Every split count, through both K/V copy paths (cp.async; TMA boxes on sm_90+, the default
  // there) and with programmatic dependent launch off and on (sm_90+; the combine then overlaps
  // the split kernel's launch and must still see all of its partials).
  for (int run = 0; run < 20; ++run) {
    const int splits = std::vector<int>{0, 1, 3, 16, 40}[run % 5];
    const int variant = run / 5;
    SCOPED_TRACE("num_splits " + std::to_string(splits) + ", " + kVariantNames[variant]);
    set_variant(variant, splits);
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, variant));
  }
}

std::vector<DecodeCase> all_cases() {
  std::vector<DecodeCase> cs;
  const auto dense = Layout::kDense, varlen = Layout::kDenseVarlen, paged = Layout::kPaged;
  // Decode, dense, GQA 32:8 and MHA, both dtypes; one sequence long enough for many splits.
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    cs.push_back({"decode", dense, {1, 1, 1}, {1000, 1000, 1000}, 32, 8, 128, false, 0, false, 0, 1.f, dt});
    cs.push_back({"decode", dense, {1, 1}, {4099, 4099}, 8, 8, 64, true, 0, false, 0, 1.f, dt});
    cs.push_back({"long", paged, {1}, {20000}, 8, 2, 128, true, 0, false, 0, 1.f, dt});
  }
  cs.back().page_size = 64;
  cs[2].page_size = 16;
  // Paged: odd page sizes, sequences ending mid-page / on a page edge, empty ones, shuffled.
  for (int ps : {16, 33, 64, 100, 256})
    cs.push_back({"san", paged, {1, 1, 1, 1, 1}, {1, ps - 1, ps, ps + 1, 3 * ps + 7}, 8, 2, 128,
                  false, ps, false, 5});
  cs.push_back({"empty", paged, {1, 1, 1}, {0, 77, 0}, 4, 4, 64, false, 16});
  cs.push_back({"empty", paged, {2, 2}, {0, 1}, 4, 1, 64, true, 16});  // Sq > Sk: unseen rows
  // Huge block table: 70000 keys in 1094 pages of 64, table rows of 4096 entries.
  cs.push_back({"bigtable", paged, {1, 1}, {70000, 5}, 4, 1, 128, false, 64, false, 4096 - 1094});
  // Sq > 1 with causal over GQA groups 1..16 (rows per block 16, 32, 64 and several blocks).
  for (int group : {1, 2, 4, 8, 16})
    for (int sq : {4, 16})
      cs.push_back({"spec", paged, {sq, sq, sq}, {sq, 300, 1500}, 16, 16 / group, 128, true, 64});
  cs.push_back({"spec", dense, {16}, {5000}, 32, 8, 128, true, 0});
  cs.push_back({"spec", dense, {3}, {2}, 8, 2, 64, true, 0});  // causal Sq > Sk
  // Varlen: dense packed and paged with cu_seqlens_q (including an empty query sequence).
  cs.push_back({"san", varlen, {1, 4, 0, 16, 3, 1}, {5000, 17, 9, 64, 0, 300}, 8, 2, 128, true, 0});
  cs.push_back({"varlen", varlen, {1, 1, 1, 1}, {1, 63, 65, 2000}, 32, 32, 64, false, 0});
  cs.push_back({"varlen", paged, {5, 1, 16, 0}, {700, 1, 16, 40}, 12, 4, 128, true, 48, true, 3});
  // Head dims 32, 96, 256.
  for (int d : {32, 96, 256}) {
    cs.push_back({"dims", paged, {1, 1, 1}, {500, 77, 3000}, 16, 4, d, false, 32});
    cs.push_back({"dims", varlen, {8, 8}, {300, 1000}, 8, 2, d, true, 0});
  }
  cs.back().tag = "san";
  // d32 and d96 further: one KV head with sequences ending mid-page (the next row NaN-poisoned);
  // the 64-row kernel's 32-key tiles on pages of 16; pages of 8 with many splits; dense with a
  // ragged last tile, fp16; large logits.
  for (int d : {32, 96}) {
    cs.push_back({"dims", paged, {1, 1, 1, 1}, {1, 63, 64, 2001}, 8, 1, d, false, 64, false, 2});
    cs.push_back({"dims", paged, {16, 16}, {16, 700}, 16, 4, d, true, 16});
    cs.push_back({"dims", paged, {1, 4}, {20000, 9}, 8, 2, d, true, 8, true, 1});
    cs.push_back(
        {"dims", dense, {1, 1}, {3001, 3001}, 32, 8, d, false, 0, false, 0, 1.f, DType::kFloat16});
    cs.push_back({"dims", paged, {1, 4}, {3000, 1025}, 8, 2, d, true, 64, true, 0, 8.f});
  }
  cs[cs.size() - 10].tag = cs[cs.size() - 5].tag = "san";
  // TMA boxes (sm_90): pages of 8 (8 boxes per operand and tile at d128), 16 and 32 with the
  // 64-row kernel's 32-key tiles (Sq 16 x group 4), 128, d256 (4 column slices) with pages of
  // 16 and 32, d64 dense with a ragged last tile; sequences ending mid-page and on page edges.
  cs.push_back({"tma", paged, {1, 1, 1, 1, 1}, {1, 7, 8, 9, 333}, 8, 2, 128, false, 8, false, 2});
  cs.push_back({"tma", paged, {16, 16, 16}, {16, 31, 500}, 16, 4, 128, true, 16});
  cs.push_back({"tma", paged, {16, 3}, {40, 1000}, 16, 4, 128, true, 32, true, 1});
  cs.push_back({"san", paged, {1, 1, 1, 1}, {0, 127, 128, 2000}, 8, 1, 128, false, 128, false, 1});
  cs.push_back({"tma", paged, {1, 4, 1}, {15, 700, 64}, 16, 4, 256, true, 16, true});
  cs.push_back({"tma", paged, {2, 2}, {33, 1500}, 8, 8, 256, true, 32});
  cs.push_back({"tma", dense, {1, 1}, {3001, 3001}, 16, 2, 64, false, 0, false, 0, 1.f, DType::kFloat16});
  // Large logits.
  cs.push_back({"large", paged, {1, 4}, {3000, 1025}, 8, 2, 128, true, 64, true, 0, 8.f});
  cs.push_back({"large", dense, {1}, {2000}, 4, 4, 64, false, 0, false, 0, 8.f, DType::kFloat16});
  return cs;
}

class DecodeAttention : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeAttention, MatchesReference) {
  SKIP_WITHOUT_GPU();
  check_case(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeAttention, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& param_info) {
                           return case_name(param_info.param) + "_" + std::to_string(param_info.index);
                         });

// d64 with both key tile widths of the 16-row kernel: every case runs with wide_tiles_override 0
// (64-key tiles, 4 stages), 2 and 3 (128-key tiles with 2 / 3 stages, wherever compiled: also on
// pages smaller than a tile, which then cross pages -- no tile_in_page, a page per row or TMA box)
// and -1 (the default choice).
// Pages of 8 to 256 keys (power of two or not), dense and dense varlen K/V; sequences of 0, 1 and
// 4099 keys ending mid-tile, mid-page and on tile and page edges; Sq 1..16 with causal; GQA
// groups 1..16; more than 16 rows, where the knob changes nothing.
std::vector<DecodeCase> wide_cases() {
  std::vector<DecodeCase> cs;
  const auto dense = Layout::kDense, varlen = Layout::kDenseVarlen, paged = Layout::kPaged;
  const DType fp16 = DType::kFloat16;  // the rest bf16
  const std::vector<int> ends = {1, 63, 64, 65, 127, 128, 129, 1000, 4099};
  const std::vector<int> one(ends.size(), 1), two(6, 2);
  cs.push_back({"san", paged, one, ends, 8, 8, 64, false, 64, false, 2});
  cs.push_back({"san", paged, one, ends, 8, 2, 64, true, 16, false, 1, 1.f, fp16});
  const std::vector<int> ends2 = {0, 127, 128, 129, 1000, 4099};  // Sq 2 > Sk 0: unseen rows
  cs.push_back({"wide", paged, two, ends2, 16, 2, 64, true, 128, false, 0, 1.f, fp16});
  cs.push_back({"san", paged, {1, 1, 1, 1, 1}, {1, 8, 9, 129, 777}, 4, 4, 64, false, 8, false, 3});
  cs.push_back({"wide", paged, {4, 1, 3, 0}, {4, 31, 33, 2000}, 8, 2, 64, true, 32, true, 1});
  cs.push_back({"wide", paged, {1, 1, 1, 1, 1}, {1, 99, 100, 101, 4099}, 8, 2, 64, false, 100});
  cs.push_back({"wide", paged, {16, 16, 16}, {16, 200, 1500}, 4, 4, 64, true, 33, false, 0, 1.f});
  cs.push_back({"wide", paged, {8, 8, 8, 8, 8}, {0, 255, 256, 257, 5000}, 4, 2, 64, true, 256});
  cs.push_back({"wide", paged, {1, 1}, {20000, 3}, 4, 4, 64, false, 64, false, 0, 1.f, fp16});
  cs.push_back({"wide", paged, {1, 4}, {3000, 1025}, 8, 2, 64, true, 64, true, 0, 8.f});
  cs.push_back({"wide", dense, {16, 16}, {4099, 4099}, 16, 16, 64, true, 0});
  cs.push_back({"wide", dense, {1, 1, 1}, {1, 1, 1}, 32, 2, 64, false, 0, false, 0, 1.f, fp16});
  cs.push_back({"wide", dense, {5}, {127}, 4, 2, 64, true, 0});
  cs.push_back({"wide", dense, {1}, {129}, 16, 1, 64, false, 0, false, 0, 8.f, fp16});
  cs.push_back({"wide", varlen, {1, 4, 0, 2}, {1, 127, 129, 1000}, 8, 2, 64, true, 0});
  // More than 16 rows: 32 (64-key tiles) and 64 (32-key tiles) whatever the knob.
  cs.push_back({"rows", paged, {8, 8}, {100, 1000}, 16, 4, 64, true, 64});
  cs.push_back({"rows", dense, {8}, {1000}, 16, 2, 64, true, 0, false, 0, 1.f, fp16});
  return cs;
}

class DecodeAttentionWide : public ::testing::TestWithParam<std::tuple<DecodeCase, int>> {};

// Puts the tile width knob back to its default when a case ends, however it ends.
struct DefaultTilesAfter {
  ~DefaultTilesAfter() { fk::decode::wide_tiles_override() = -1; }
};

TEST_P(DecodeAttentionWide, MatchesReference) {
  SKIP_WITHOUT_GPU();
  const DefaultTilesAfter restore;
  fk::decode::wide_tiles_override() = std::get<1>(GetParam());
  check_case(std::get<0>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    Grid, DecodeAttentionWide,
    ::testing::Combine(::testing::ValuesIn(wide_cases()), ::testing::Values(0, 2, 3, -1)),
    [](const ::testing::TestParamInfo<std::tuple<DecodeCase, int>>& param_info) {
      const int knob = std::get<1>(param_info.param);
      return case_name(std::get<0>(param_info.param)) + "_tiles" +
             (knob < 0 ? std::string("default") : std::to_string(knob)) + "_" +
             std::to_string(param_info.index);
    });

// An empty sequence alone, one split: O = 0 and LSE = -inf straight from the split kernel.
TEST(DecodeAttentionEdge, AllEmptyIsZeroAndMinusInf) {
  SKIP_WITHOUT_GPU();
  check_case({"allempty", Layout::kPaged, {3, 3}, {0, 0}, 8, 2, 128, false, 16});
  check_case({"allempty", Layout::kDenseVarlen, {1, 2}, {0, 0}, 8, 8, 64, true, 0});
}

// A NaN input makes NaN exactly the rows that read it, O and LSE, whatever the split count and
// wherever the splits merge (combine kernel, in the split kernel): a split whose keys held a
// NaN used to write LSE -inf ("saw no key"), the merge dropped it, and the row came back finite
// without that split's keys. Sequence 0 (20000 keys): one K element NaN in KV head 1, read by q
// heads 4..7 through one split only; sequence 1 (300 keys): q head 2 NaN, read by every split.
TEST(DecodeAttentionEdge, NaNPoisonsOnlyTheRowsThatReadItWhateverTheSplit) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"nan", Layout::kPaged, {1, 1}, {20000, 300}, 8, 2, 128, false, 64};
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  HostProblem bad = hp;
  const int d = c.head_dim, key = 12345;
  const size_t page = size_t(hp.block_table[size_t(key / c.page_size)]);  // sequence 0's row
  const uint16_t nan = 0x7FC0;                                            // bf16
  bad.k_all[(page * c.page_size + key % c.page_size) * c.heads_kv * d + 1 * d + 7] = nan;
  bad.q_all[(size_t(1) * c.heads_q + 2) * d + 3] = nan;
  DeviceProblem clean_dev(c, hp), bad_dev(c, bad);
  const DefaultKnobsAfter restore;
  const int group = c.heads_q / c.heads_kv;
  const auto lse_at = [&](int row, int h) { return size_t(row) * c.heads_q + h; };  // Sq 1
  const auto read_nan = [&](int row, int h) {
    return (row == 0 && h / group == 1) || (row == 1 && h == 2);
  };
  for (int variant : {0, 2, 3})
    for (int splits : {1, 3, 16, 40}) {
      SCOPED_TRACE("num_splits " + std::to_string(splits) + ", " + kVariantNames[variant]);
      set_variant(variant, splits);
      tu::RunAnswers clean, got;
      ASSERT_NO_FATAL_FAILURE(run_once(c, clean_dev, splits, &clean));
      ASSERT_NO_FATAL_FAILURE(run_once(c, bad_dev, splits, &got));
      ASSERT_TRUE(tu::all_finite(clean.out));
      EXPECT_TRUE(tu::nan_only_where_read(clean, got, 2, c.heads_q, d, lse_at, read_nan));
    }
}

// Runs c with each of split_counts (cycled over `runs` launches, default knobs) and checks every
// answer and which merge ran: in the split kernel when the block's partial rows over all splits
// (rows x splits x head_dim x 4 bytes) are at most 8 KB, else the combine kernel.
void check_merges(const DecodeCase& c, int rows, const std::vector<int>& split_counts, int runs) {
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  DeviceProblem dev(c, hp);
  const DefaultKnobsAfter restore;
  for (int run = 0; run < runs; ++run) {
    const int splits = split_counts[run % split_counts.size()];
    SCOPED_TRACE("run " + std::to_string(run) + ", num_splits " + std::to_string(splits));
    set_variant(3, splits);
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, 3));
    const bool small = rows * splits * c.head_dim * 4 <= 8192;
    ASSERT_EQ(fk::decode::last_merge(), small ? 2 : 1)
        << "2: in the split kernel, 1: combine kernel";
  }
  fk::decode::fused_merge_override() = 0;
  ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, split_counts[0], 0));
  EXPECT_EQ(fk::decode::last_merge(), 1) << "knob 0: the combine kernel";
  fk::decode::fused_merge_override() = 2;  // past the size limit: all of these fit in smem
  for (int splits : split_counts) {
    SCOPED_TRACE("knob 2, num_splits " + std::to_string(splits));
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, 2));
    EXPECT_EQ(fk::decode::last_merge(), 2) << "knob 2: in the split kernel";
  }
}

// The in-kernel merge: the split kernel's last block per group merges and no combine kernel
// runs, and the group counters return to zero: 200 launches on one stream reuse its counter
// slot, and a counter left behind would merge too early (NaN-poisoned O read back) or never.
// d32 MHA, one row per block: every count from 2 to 33 merges in place; d128 GQA 8:2 (4 rows):
// 2-4 splits in place, 5 and 16 through the combine kernel.
TEST(DecodeAttentionEdge, InKernelMergeRunsAndLeavesItsCountersAtZero) {
  SKIP_WITHOUT_GPU();
  std::vector<int> counts(32);
  std::iota(counts.begin(), counts.end(), 2);
  check_merges({"merge", Layout::kPaged, {1, 1, 1}, {20000, 5, 3001}, 8, 8, 32, false, 64}, 1,
               counts, 200);
  check_merges({"merge", Layout::kPaged, {1, 1, 1}, {9000, 5, 3001}, 8, 2, 128, false, 64}, 4,
               {2, 3, 4, 5, 16}, 20);
}

// One problem launched again and again on its own stream, each launch NaN-poisoned first and its
// O copied aside after, all queued without a host sync (check() syncs and checks every copy).
struct QueuedLaunches {
  HostProblem hp;
  References ref;
  tu::EmulatedError emu;
  DeviceProblem dev;
  size_t out_bytes;
  tu::DeviceBuffer workspace, results;
  cudaStream_t stream = nullptr;
  int queued = 0;

  QueuedLaunches(const DecodeCase& c, std::mt19937_64&& rng, int splits, int launches)
      : hp(make_problem(c, rng)),
        ref(compute_references(c, hp, uses_varlen_lse(c))),
        emu(worst_emulation(ref)),
        dev(c, hp),
        out_bytes(hp.q_all.size() * 2),
        workspace(fk::decode_workspace_bytes(dev.p, splits)),
        results(out_bytes * launches) {
    dev.p.num_splits = splits;
    dev.p.workspace = workspace.get();
    dev.p.workspace_bytes = workspace.bytes();
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  }
  ~QueuedLaunches() { cudaStreamDestroy(stream); }

  void queue_one() {
    ASSERT_EQ(cudaMemsetAsync(dev.p.o, tu::kPoisonByte, out_bytes, stream), cudaSuccess);
    ASSERT_EQ(fk::run_decode(dev.p, stream), cudaSuccess);
    ASSERT_EQ(fk::decode::last_merge(), 2) << "merged in the split kernel";
    char* at = results.as<char>() + out_bytes * queued++;
    ASSERT_EQ(cudaMemcpyAsync(at, dev.p.o, out_bytes, cudaMemcpyDeviceToDevice, stream),
              cudaSuccess);
  }

  void check(DType dtype) {
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<uint16_t> all(out_bytes / 2 * queued);
    ASSERT_EQ(results.download(&all), cudaSuccess);
    for (int i = 0; i < queued; ++i) {
      SCOPED_TRACE("launch " + std::to_string(i));
      const std::vector<uint16_t> one(all.begin() + i * (out_bytes / 2),
                                      all.begin() + (i + 1) * (out_bytes / 2));
      const std::vector<double> got = tu::to_double(dtype, one);
      ASSERT_TRUE(tu::all_finite(got));
      ASSERT_TRUE(tu::within_twice_emulated(tu::error_vs(got, ref.out), emu.out));
    }
  }
};

// Launches on two streams merging in the split kernel at once: stream A queues 64 long launches
// (8 blocks of 256k keys each), stream B then 64 short ones while A runs; every answer is checked.
// (This did not catch 44ca9a6's round-robin slots in 10 runs: two launches sharing a slot corrupt
// the counters only if their blocks finish at the same moment. The next test does.)
TEST(DecodeAttentionEdge, InKernelMergeOnTwoStreamsAtOnce) {
  SKIP_WITHOUT_GPU();
  const DecodeCase long_case{"mergeA", Layout::kPaged, {1}, {2000000}, 1, 1, 32, false, 64};
  const DecodeCase short_case{"mergeB", Layout::kPaged, {1, 1, 1}, {3000, 700, 1500}, 8, 8,
                              32,       false,          64};
  QueuedLaunches a(long_case, std::mt19937_64(tu::case_seed("mergeA")), 8, 64);
  QueuedLaunches b(short_case, std::mt19937_64(tu::case_seed("mergeB")), 8, 64);
  const DefaultKnobsAfter restore;
  set_variant(3, 8);
  for (int i = 0; i < 64; ++i) ASSERT_NO_FATAL_FAILURE(a.queue_one());
  for (int i = 0; i < 64; ++i) ASSERT_NO_FATAL_FAILURE(b.queue_one());
  ASSERT_NO_FATAL_FAILURE(a.check(long_case.dtype));
  ASSERT_NO_FATAL_FAILURE(b.check(short_case.dtype));
}

// A counter slot whose launch has not run yet stays with its stream: stream A's launch waits
// behind a gate while stream B runs 200 launches (each to completion); none of B's may take A's
// slot (round-robin slots, 44ca9a6, handed B every slot within 64 launches). Both answers checked.
// One launch first loads the kernel (tu::StreamGate says why).
TEST(DecodeAttentionEdge, InKernelMergeKeepsAPendingLaunchsSlot) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"mergeG", Layout::kPaged, {1, 1, 1}, {3000, 700, 1500}, 8, 8, 32, false, 64};
  QueuedLaunches a(c, std::mt19937_64(tu::case_seed("mergeG")), 8, 1);
  QueuedLaunches b(c, std::mt19937_64(tu::case_seed("mergeG")), 8, 201);
  const DefaultKnobsAfter restore;
  set_variant(3, 8);
  ASSERT_NO_FATAL_FAILURE(b.queue_one());
  ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  tu::StreamGate gate(a.stream);
  ASSERT_NO_FATAL_FAILURE(a.queue_one());
  const int a_slot = fk::last_counter_slot();
  ASSERT_GE(a_slot, 0);
  for (int i = 0; i < 200; ++i) {
    ASSERT_NO_FATAL_FAILURE(b.queue_one());
    ASSERT_NE(fk::last_counter_slot(), a_slot) << "launch " << i << " of stream B";
    ASSERT_EQ(cudaStreamSynchronize(b.stream), cudaSuccess);
  }
  const bool serialized = gate.opened_by_itself();
  gate.release();
  ASSERT_NO_FATAL_FAILURE(a.check(c.dtype));
  ASSERT_NO_FATAL_FAILURE(b.check(c.dtype));
  if (serialized)
    GTEST_SKIP() << "stream B ran only once gated stream A's gate timed out: this "
                    "GPU (or a sanitizer) serializes streams, so nothing was tested";
}

TEST(DecodeAttentionApi, RunRejectsUnsupported) {
  SKIP_WITHOUT_GPU();
  fk::DecodeParams p = fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 16, 2, 2, 48, false, 0.1f);
  EXPECT_EQ(fk::run_decode(p, nullptr), cudaErrorInvalidValue);
}

// The checks below touch no GPU and run everywhere.
TEST(DecodeAttentionApi, SupportedNamesTheField) {
  static const uint16_t kBuf[64] __attribute__((aligned(16))) = {};
  auto with_ptrs = [](fk::DecodeParams p) {
    p.q = p.k = p.v = kBuf;
    p.o = const_cast<uint16_t*>(kBuf);
    return p;
  };
  fk::DecodeParams p =
      with_ptrs(fk::make_dense_decode_params(DType::kBFloat16, 2, 1, 100, 8, 2, 128, true, 0.1f));
  EXPECT_EQ(fk::decode_supported(p), "");
  p.head_dim = 48;
  EXPECT_NE(fk::decode_supported(p).find("head_dim 48"), std::string::npos);
  p = with_ptrs(fk::make_dense_decode_params(DType::kBFloat16, 2, 1, 100, 6, 4, 128, true, 0.1f));
  EXPECT_NE(fk::decode_supported(p).find("multiple of heads_kv"), std::string::npos);
  p = with_ptrs(fk::make_dense_decode_params(DType::kFloat16, 2, 1, 100, 8, 2, 64, false, 0.1f));
  static const int32_t kTable[4] = {};
  p.block_table = kTable;
  p.block_table_stride = 2;
  p.page_size = 64;  // a table row addresses 128 keys >= seqlen_k
  EXPECT_NE(fk::decode_supported(p).find("seqlens_k"), std::string::npos);
  p.seqlens_k = kTable;
  EXPECT_EQ(fk::decode_supported(p), "");
  p.page_size = 0;
  EXPECT_NE(fk::decode_supported(p).find("page_size"), std::string::npos);
  p = with_ptrs(fk::make_dense_decode_params(DType::kFloat16, 1, 1, 100, 8, 2, 64, false, 0.1f));
  p.num_splits = 129;
  EXPECT_NE(fk::decode_supported(p).find("num_splits"), std::string::npos);
  p.num_splits = 0;
  p.k_row_stride = 100;
  EXPECT_NE(fk::decode_supported(p).find("k strides"), std::string::npos);
}

// p with aligned dummy q/k/v/o, for the checks that touch no GPU.
fk::DecodeParams with_dummy_ptrs(fk::DecodeParams p) {
  alignas(16) static const uint16_t kBuf[64] = {};
  p.q = p.k = p.v = kBuf;
  p.o = const_cast<uint16_t*>(kBuf);
  return p;
}

// With packed queries seqlen_q bounds every sequence's rows: the row blocks, the kernel and the
// in-kernel merge's shared memory are sized from it. Only their sum (total_q) is on the host.
TEST(DecodeAttentionApi, VarlenQNeedsASeqlenQThatBoundsEverySequence) {
  static const int32_t kCu[3] = {0, 4, 8};
  fk::DecodeParams p = with_dummy_ptrs(
      fk::make_dense_decode_params(DType::kBFloat16, 2, 4, 3000, 8, 1, 128, false, 0.088f));
  p.cu_seqlens_q = kCu;
  p.total_q = 8;
  EXPECT_EQ(fk::decode_supported(p), "");  // batch * seqlen_q == total_q
  for (int seqlen_q : {3, 0}) {            // 8 rows in 2 sequences of <= 3; no bound at all
    p.seqlen_q = seqlen_q;
    EXPECT_NE(fk::decode_supported(p).find("seqlen_q"), std::string::npos)
        << seqlen_q << ": " << fk::decode_supported(p);
  }
  p.total_q = 0;  // no rows: nothing to size
  EXPECT_EQ(fk::decode_supported(p), "");
}

// The workspace must be 256-byte aligned, as the header says (the float4 partials need 16).
TEST(DecodeAttentionApi, SupportedRefusesAMisalignedWorkspace) {
  alignas(256) static char workspace[1 << 16];
  fk::DecodeParams p = with_dummy_ptrs(
      fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 20000, 8, 1, 128, false, 0.088f));
  p.num_splits = 8;
  p.workspace = workspace;
  p.workspace_bytes = sizeof(workspace) - 256;
  EXPECT_EQ(fk::decode_supported(p), "");
  for (int offset : {4, 16, 128}) {
    p.workspace = workspace + offset;
    EXPECT_NE(fk::decode_supported(p).find("workspace"), std::string::npos)
        << offset << ": " << fk::decode_supported(p);
  }
  p.workspace = workspace + 256;
  EXPECT_EQ(fk::decode_supported(p), "");
}

// seqlen_k bounds every Sk_b, and the kernels read a sequence's table row unbounded: a bound past
// the row's keys (block_table_stride * page_size) is refused; pages of any size.
TEST(DecodeAttentionApi, SupportedRefusesLengthsPastTheBlockTablesRows) {
  static const int32_t kTable[6] = {0, 1, 2, 3, 4, 5}, kLengths[2] = {99, 64};
  fk::DecodeParams p = with_dummy_ptrs(
      fk::make_dense_decode_params(DType::kBFloat16, 2, 1, 128, 8, 2, 128, false, 0.088f));
  p.block_table = kTable;
  p.seqlens_k = kLengths;
  p.block_table_stride = 2;
  p.page_size = 64;
  p.k_batch_stride = p.v_batch_stride = int64_t{64} * p.k_row_stride;
  EXPECT_EQ(fk::decode_supported(p), "");  // 128 keys = 2 entries x 64
  p.seqlen_k = 129;
  EXPECT_NE(fk::decode_supported(p).find("block_table_stride"), std::string::npos)
      << fk::decode_supported(p);
  p.block_table_stride = 3;
  p.page_size = 33;
  p.k_batch_stride = p.v_batch_stride = int64_t{33} * p.k_row_stride;
  p.seqlen_k = 99;
  EXPECT_EQ(fk::decode_supported(p), "");
  p.seqlen_k = 100;
  EXPECT_NE(fk::decode_supported(p).find("block_table_stride"), std::string::npos)
      << fk::decode_supported(p);
}

// p (on dev's buffers) is refused before anything runs: decode_supported names `field` (asked
// first: a build without the check stops here rather than launch), run_decode returns
// cudaErrorInvalidValue and O keeps its poison.
void expect_refused(DeviceProblem& dev, const fk::DecodeParams& p, const std::string& field) {
  ASSERT_NE(fk::decode_supported(p).find(field), std::string::npos) << fk::decode_supported(p);
  ASSERT_EQ(dev.o.poison(), cudaSuccess);
  EXPECT_EQ(fk::run_decode(p, nullptr), cudaErrorInvalidValue);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(dev.out_elems);
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  const std::vector<double> got = tu::to_double(p.dtype, out);
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](double x) { return std::isnan(x); }))
      << "O was written";
}

// Packed queries of 4 rows per sequence under a seqlen_q of 1 (rows 2 and 3 went unwritten, or
// got the combine's copy of unwritten partials) or of 0 (the in-kernel merge, sized for 0 rows,
// staged its partials past the block's shared memory) are refused before any launch, whatever
// the split count; seqlen_q 4 computes every row.
TEST(DecodeAttentionEdge, VarlenQBelowItsRowsIsRefusedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"undersq", Layout::kPaged, {4, 4}, {3000, 700}, 8, 1, 128, false, 64, true};
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  DeviceProblem dev(c, hp);
  ASSERT_EQ(dev.p.seqlen_q, 4);
  const DefaultKnobsAfter restore;
  for (int splits : {1, 8, 40}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    set_variant(3, splits);
    for (int seqlen_q : {1, 0}) {
      fk::DecodeParams p = dev.p;
      p.seqlen_q = seqlen_q;
      p.num_splits = splits;
      ASSERT_NO_FATAL_FAILURE(expect_refused(dev, p, "seqlen_q"));
    }
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, 3));
  }
}

// A workspace off the documented 256 bytes (4: the float4 partial stores faulted; 16: enough for
// them, not what the header promises) is refused before any launch, merged by the combine kernel
// or in the split kernel alike; 256 bytes into the same buffer computes the answer.
TEST(DecodeAttentionEdge, MisalignedWorkspaceIsRefusedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"wsalign", Layout::kPaged, {1, 1}, {3000, 1500}, 8, 2, 128, false, 64};
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  DeviceProblem dev(c, hp);
  const int splits = 4;  // 4 rows x 4 splits x 128 x 4 bytes: small enough to merge in place
  const size_t bytes = fk::decode_workspace_bytes(dev.p, splits);
  tu::DeviceBuffer workspace(bytes + 256);
  dev.p.workspace_bytes = bytes;
  const DefaultKnobsAfter restore;
  for (int merge : {0, -1}) {  // the combine kernel; the default (in the split kernel here)
    SCOPED_TRACE("fused_merge_override " + std::to_string(merge));
    set_variant(3, splits);
    fk::decode::fused_merge_override() = merge;
    for (int offset : {4, 16}) {
      fk::DecodeParams p = dev.p;
      p.num_splits = splits;
      p.workspace = workspace.as<char>() + offset;
      ASSERT_NO_FATAL_FAILURE(expect_refused(dev, p, "workspace"));
    }
    dev.p.workspace = workspace.as<char>() + 256;
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, 3));
    EXPECT_EQ(fk::decode::last_merge(), merge == 0 ? 1 : 2) << "2: in the split kernel";
  }
}

// Sequence 0 at 192 keys with a table row of 2 entries x 64 keys: its keys 128..191 would come
// from sequence 1's row (block_table[0 * 2 + 2]). The launch is refused before it runs; a bound of
// exactly the row's 128 keys computes the answer.
TEST(DecodeAttentionEdge, LengthPastTheTableRowIsRefusedBeforeLaunch) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"tablecap", Layout::kPaged, {1, 1}, {128, 64}, 8, 2, 128, false, 64};
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  DeviceProblem dev(c, hp);
  ASSERT_EQ(hp.table_stride, 2);
  const DefaultKnobsAfter restore;
  for (int splits : {1, 2}) {
    SCOPED_TRACE("num_splits " + std::to_string(splits));
    set_variant(3, splits);
    ASSERT_EQ(dev.seqlens_k.upload(std::vector<int32_t>{192, 64}), cudaSuccess);
    fk::DecodeParams p = dev.p;
    p.seqlen_k = 192;
    p.num_splits = splits;
    ASSERT_NO_FATAL_FAILURE(expect_refused(dev, p, "block_table_stride"));
    ASSERT_EQ(dev.seqlens_k.upload(std::vector<int32_t>{128, 64}), cudaSuccess);
    ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, splits, 3));
  }
}

// Every L2 prefetch hint the benchmark's knob can select computes the same result.
TEST(DecodeAttentionEdge, PrefetchHintsAgree) {
  SKIP_WITHOUT_GPU();
  for (int bytes : {0, 128, 256}) {
    SCOPED_TRACE("l2 prefetch " + std::to_string(bytes));
    fk::decode::l2_prefetch_override() = bytes;
    check_case({"hint", Layout::kPaged, {1, 1}, {900, 33}, 8, 2, 128, true, 16});
  }
  fk::decode::l2_prefetch_override() = -1;
}

// The split-count autotuner: every candidate ran, matched the heuristic's output and was timed;
// best is the fastest of them; an unsupported problem is refused before anything is allocated.
TEST(DecodeAttentionTune, TimesEveryCheckedSplitCount) {
  SKIP_WITHOUT_GPU();
  fk::DecodeParams p =
      fk::make_dense_decode_params(DType::kBFloat16, 2, 1, 20011, 8, 2, 128, false, 0.09f);
  static const int32_t kMarker = 0;
  p.block_table = &kMarker;  // only says "paged": the tuner builds its own pool and table
  p.page_size = 64;
  fk::TuneOptions options;
  options.rotate_bytes = size_t{64} << 20;
  fk::DecodeTuneReport report;
  ASSERT_EQ(fk::tune_decode_splits(p, nullptr, options, &report), cudaSuccess);
  ASSERT_GE(report.best, 0);
  ASSERT_GE(report.heuristic_index, 0);
  EXPECT_EQ(report.timings[report.heuristic_index].num_splits, report.heuristic);
  EXPECT_GE(report.timings.size(), 3u);
  for (const fk::DecodeSplitTiming& t : report.timings) {
    SCOPED_TRACE("splits " + std::to_string(t.num_splits));
    EXPECT_TRUE(t.ok) << t.error;
    EXPECT_GT(t.median_ms, 0.0);
    EXPECT_LE(report.timings[report.best].median_ms, t.median_ms);
  }
  p.head_dim = 80;
  EXPECT_EQ(fk::tune_decode_splits(p, nullptr, options, &report), cudaErrorInvalidValue);
  EXPECT_EQ(report.best, -1);
}

// After cudaDeviceReset (a library user recovering from a device fault) the kernels run as before
// in the new context: the d128 kernel's raised shared-memory limit (109 KB) is raised again, and
// the in-kernel merge takes a counter slot afresh (the old slots' events went with the old
// context; the counters' address is looked up per launch). Last in the file: the reset frees
// every buffer other tests could still hold.
TEST(DecodeAttentionReset, RunsAfterDeviceReset) {
  SKIP_WITHOUT_GPU();
  const DecodeCase c{"reset", Layout::kPaged, {1, 1}, {3000, 1500}, 8, 2, 128, false, 64};
  std::mt19937_64 rng(tu::case_seed(case_name(c)));
  const HostProblem hp = make_problem(c, rng);
  const References ref = compute_references(c, hp, uses_varlen_lse(c));
  const tu::EmulatedError emu = worst_emulation(ref);
  const DefaultKnobsAfter restore;
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "before the reset" : "after the reset");
    {
      DeviceProblem dev(c, hp);
      set_variant(3, 3);
      ASSERT_NO_FATAL_FAILURE(check_run(c, hp, dev, ref, emu, 3, 3));
      EXPECT_EQ(fk::decode::last_merge(), 2) << "merged in the split kernel";
    }
    if (round == 0) {
      ASSERT_EQ(cudaDeviceReset(), cudaSuccess);
    }
  }
}

}  // namespace
}  // namespace flashserve::kernels
