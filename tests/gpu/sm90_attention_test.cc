// The sm90 kernel family (kernels/cuda/sm90/, wgmma + TMA + warp specialization) on its own:
// fresh random inputs over odd sizes, causal (bottom-right, Sq != Sk), GQA/MQA, padded strides,
// long K/V rings, large logits; NaN-poisoned outputs and LSE. Each result is checked against a
// plain fp64 reference twice: within 2x the error of a same-precision emulation of the kernel
// (its block_n, backwards walk and lazy rescale), and within a fixed dtype tolerance. The sm90
// result must also agree with the sm80 family's. Skips without a compute-capability 9.0 GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/cuda/counter_slots.h"    // last_counter_slot (internal)
#include "../../kernels/cuda/sm90/tile_order.h"  // tile_coord (host arithmetic, internal)
#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "gpu_test_support.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

// The sm90 configurations compiled for (dtype, head_dim), when this device can run them.
std::vector<fk::KernelConfig> sm90_configs(DType dtype, int head_dim) {
  std::vector<fk::KernelConfig> out;
  for (const fk::KernelConfig& c : fk::candidates(dtype, head_dim, false))
    if (c.family == fk::KernelFamily::kSm90) out.push_back(c);
  return out;
}

// The family's default for (dtype, head_dim) (the first one listed).
std::optional<fk::KernelConfig> sm90_config(DType dtype, int head_dim) {
  const std::vector<fk::KernelConfig> all = sm90_configs(dtype, head_dim);
  if (all.empty()) return std::nullopt;
  return all.front();
}

#define SKIP_WITHOUT_SM90(dtype, head_dim)                                                  \
  SKIP_WITHOUT_GPU();                                                                       \
  if (!sm90_config(dtype, head_dim))                                                        \
  GTEST_SKIP() << "no sm90 kernel for this device/build (needs compute capability 9.0 and " \
                  "90 in FLASHSERVE_CUDA_ARCHS): skipping"

struct Case {
  int batch, seqlen_q, seqlen_k, heads_q, heads_kv;
  bool causal;
  float input_scale;  // > 1: large logits
  int pad = 0;        // extra heads per row and rows per batch (non-contiguous strides)
};

struct Param {
  DType dtype;
  int head_dim;
  Case c;
};

std::string param_name(const Param& prm) {
  const Case& c = prm.c;
  return std::string(prm.dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" +
         std::to_string(prm.head_dim) + "_b" + std::to_string(c.batch) + "_sq" +
         std::to_string(c.seqlen_q) + "_sk" + std::to_string(c.seqlen_k) + "_h" +
         std::to_string(c.heads_q) + "x" + std::to_string(c.heads_kv) +
         (c.causal ? "_causal" : "") + (c.input_scale != 1.f ? "_x8" : "") +
         (c.pad ? "_pad" + std::to_string(c.pad) : "");
}

// Host tensors of one problem, strided as p says (p points at qkv: its buffers survive a move).
struct Problem {
  AttentionParams p;
  tu::HostQkv qkv;
};

Problem make_problem(const Param& prm) {
  const Case& c = prm.c;
  Problem pr;
  pr.p = make_contiguous_params(prm.dtype, c.batch, c.seqlen_q, c.seqlen_k, c.heads_q, c.heads_kv,
                                prm.head_dim, c.causal, 1.f / std::sqrt(float(prm.head_dim)));
  tu::pad_strides(&pr.p, c.pad, c.pad);
  std::mt19937_64 rng(tu::case_seed(param_name(prm)));
  pr.qkv = tu::random_qkv(&pr.p, c.input_scale, rng);
  return pr;
}

struct Result {
  std::vector<double> out;  // [batch, seqlen_q, heads_q, head_dim] contiguous
  std::vector<float> lse;
};

// Runs cfg on the problem with NaN-poisoned O (including the padding) and LSE.
void run_config(const Problem& pr, const fk::KernelConfig& cfg, Result* r) {
  const AttentionParams& hp = pr.p;
  tu::DeviceProblem dev(hp);
  ASSERT_EQ(dev.upload(hp), cudaSuccess);
  ASSERT_EQ(dev.poison(), cudaSuccess);
  const AttentionParams p = dev.params(hp, true);
  ASSERT_EQ(fk::supported(p), "");
  ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> out(tu::q_elements(hp));
  r->lse.resize(tu::lse_elements(hp));
  ASSERT_EQ(dev.o.download(&out), cudaSuccess);
  ASSERT_EQ(dev.lse.download(&r->lse), cudaSuccess);
  r->out = tu::gather_output(hp, out);
  // Padding must stay poisoned: the kernel writes only its rows and heads.
  if (hp.o_row_stride > int64_t(hp.heads_q) * hp.head_dim) {
    const size_t pad_index = size_t(hp.heads_q) * hp.head_dim;  // first padding element of row 0
    EXPECT_TRUE(std::isnan(tu::to_double(hp.dtype, out[pad_index]))) << "padding overwritten";
  }
}

class Sm90Attention : public ::testing::TestWithParam<Param> {};

TEST_P(Sm90Attention, MatchesFp64Reference) {
  const Param& prm = GetParam();
  SKIP_WITHOUT_SM90(prm.dtype, prm.head_dim);
  const Problem pr = make_problem(prm);
  tu::Fp64Reference ref(pr.p);
  for (const fk::KernelConfig& cfg : sm90_configs(prm.dtype, prm.head_dim)) {
    SCOPED_TRACE("config " + cfg.name());
    const tu::EmulatedError& emu = ref.emulated(cfg);
    Result r;
    ASSERT_NO_FATAL_FAILURE(run_config(pr, cfg, &r));
    ASSERT_TRUE(tu::all_finite(r.out));
    const tu::ErrorStats err = tu::error_vs(r.out, ref.out());
    EXPECT_TRUE(tu::within_twice_emulated(err, emu.out));
    // The plain check: relative L2 error within a few rounding units of the output dtype.
    EXPECT_LE(err.rel_l2, prm.dtype == DType::kFloat16 ? 4e-3 : 2e-2);
    ASSERT_TRUE(tu::lse_matches(r.lse, ref.lse(), emu.lse));
  }
}

TEST_P(Sm90Attention, AgreesWithSm80) {
  const Param& prm = GetParam();
  SKIP_WITHOUT_SM90(prm.dtype, prm.head_dim);
  if (prm.c.seqlen_q * prm.c.seqlen_k > 300 * 300) GTEST_SKIP() << "covered by the small cases";
  const Problem pr = make_problem(prm);
  fk::KernelConfig sm80;
  for (const fk::KernelConfig& c : fk::candidates(prm.dtype, prm.head_dim, prm.c.causal))
    if (c.family == fk::KernelFamily::kSm80) {
      sm80 = c;
      break;
    }
  Result a, b;
  ASSERT_NO_FATAL_FAILURE(run_config(pr, *sm90_config(prm.dtype, prm.head_dim), &a));
  ASSERT_NO_FATAL_FAILURE(run_config(pr, sm80, &b));
  double max_o = 0, max_diff = 0;
  for (size_t i = 0; i < a.out.size(); ++i) {
    max_o = std::max(max_o, std::abs(b.out[i]));
    max_diff = std::max(max_diff, std::abs(a.out[i] - b.out[i]));
  }
  const double ulp = prm.dtype == DType::kFloat16 ? 0x1p-10 : 0x1p-7;
  EXPECT_LE(max_diff, 8 * ulp * std::max(max_o, 1e-3));
}

std::vector<Param> all_params() {
  std::vector<Case> cases;
  for (int s : {1, 17, 64, 127, 129})
    for (bool causal : {false, true}) cases.push_back({1, s, s, 3, 3, causal, 1.f});
  cases.push_back({1, 1025, 1025, 1, 1, true, 1.f});
  cases.push_back({1, 1000, 1000, 2, 2, false, 1.f});
  cases.push_back({1, 2049, 2049, 1, 1, false, 1.f});  // 17 K/V tiles: the ring wraps 8 times
  cases.push_back({2, 130, 130, 16, 16, false, 1.f});  // heads 16
  cases.push_back({1, 257, 257, 32, 8, true, 1.f});    // GQA 32:8
  cases.push_back({2, 97, 300, 8, 1, false, 1.f});     // MQA 8:1, Sq < Sk
  cases.push_back({1, 65, 1025, 3, 3, true, 1.f});     // causal Sq < Sk
  cases.push_back({1, 1025, 65, 3, 3, true, 1.f});     // causal Sq > Sk: rows see no key
  cases.push_back({1, 200, 17, 2, 1, true, 1.f});      // causal Sq > Sk, short
  cases.push_back({5, 63, 130, 3, 1, true, 1.f});      // batch 5
  cases.push_back({1, 1, 4099, 3, 3, true, 1.f});      // decode-like
  cases.push_back({1, 127, 1025, 3, 3, false, 8.f});   // large logits: lazy rescale moves
  cases.push_back({2, 333, 333, 2, 1, true, 8.f});
  cases.push_back({2, 77, 77, 4, 2, true, 1.f, 8});  // padded strides (rows, batches)
  cases.push_back({2, 300, 520, 4, 2, false, 1.f, 3});
  // More tiles than SMs (300 / 320 on an H100): blocks of the persistent grid walk 2-3 tiles,
  // so both Q buffers are reused (and their O stores awaited) in more than one round.
  cases.push_back({3, 65, 65, 100, 4, false, 1.f});
  cases.push_back({2, 130, 130, 80, 8, true, 1.f});
  std::vector<Param> params;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    for (int hd : {32, 64, 96, 128, 256})
      for (const Case& c : cases) params.push_back({dtype, hd, c});
  return params;
}

INSTANTIATE_TEST_SUITE_P(Grid, Sm90Attention, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& param_info) {
                           return param_name(param_info.param);
                         });

// A layout TMA cannot describe (zero head stride over several heads) is not given to sm90:
// select() falls back to the sm80 family and run() with an sm90 configuration refuses.
TEST(Sm90Dispatch, FallsBackWhereTmaCannotRun) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 128);
  AttentionParams p =
      make_contiguous_params(DType::kBFloat16, 1, 4096, 4096, 4, 4, 128, false, 0.1f);
  alignas(16) static char dummy[16];
  p.q = p.k = p.v = dummy;
  p.o = dummy;
  EXPECT_EQ(fk::select(p, 132).family, fk::KernelFamily::kSm90);
  p.k_head_stride = p.v_head_stride = 0;  // every head reads the same K/V (a broadcast view)
  ASSERT_EQ(fk::supported(p), "");
  EXPECT_EQ(fk::select(p, 132).family, fk::KernelFamily::kSm80);
  EXPECT_EQ(fk::run(p, *sm90_config(DType::kBFloat16, 128), nullptr), cudaErrorInvalidValue);
  // The same for the output, which the sm90 kernels write with TMA stores.
  p.k_head_stride = p.v_head_stride = 128;
  EXPECT_EQ(fk::select(p, 132).family, fk::KernelFamily::kSm90);
  p.o_head_stride = 0;  // accepted by supported() (heads overwrite each other), not by TMA
  ASSERT_EQ(fk::supported(p), "");
  EXPECT_EQ(fk::select(p, 132).family, fk::KernelFamily::kSm80);
  EXPECT_EQ(fk::run(p, *sm90_config(DType::kBFloat16, 128), nullptr), cudaErrorInvalidValue);
}

// Fewer than half a wave of 128-row tiles: the sm80 family, unless every row is long (d128 from
// 384 keys and queries, d64 from 768, d96 and d256 from 256, d32 never; H200 sessions 29-30: a TP
// shard's single prompt, B1 H8 S1024 d128, ran 1.27x faster on sm90 than on sm80's 64-row tiles,
// d96 S256 1.07-1.14x). Packed batches keep sm80.
TEST(Sm90Dispatch, SmallGridsTakeSm90WhereRowsAreLong) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 128);
  auto family = [](int d, int b, int h, int sq, int sk, bool causal) {
    AttentionParams p = make_contiguous_params(DType::kBFloat16, b, sq, sk, h, h, d, causal, 0.1f);
    alignas(16) static char dummy[16];  // select() looks at the layout, never at the data
    p.q = p.k = p.v = p.o = dummy;
    return fk::select(p, 132).family;
  };
  const auto sm80 = fk::KernelFamily::kSm80, sm90 = fk::KernelFamily::kSm90;
  EXPECT_EQ(family(128, 1, 8, 1024, 1024, false), sm90);  // 64 tiles
  EXPECT_EQ(family(128, 1, 4, 512, 512, true), sm90);     // 16 tiles
  EXPECT_EQ(family(128, 1, 8, 384, 384, false), sm90);    // 24 tiles
  EXPECT_EQ(family(128, 1, 8, 320, 320, true), sm80);
  EXPECT_EQ(family(128, 1, 8, 256, 256, false), sm80);
  EXPECT_EQ(family(128, 1, 8, 256, 4096, false), sm80);  // short queries
  EXPECT_EQ(family(128, 1, 1, 4096, 256, false), sm80);  // short keys (32 tiles)
  EXPECT_EQ(family(128, 1, 1, 4096, 4096, true), sm90);
  EXPECT_EQ(family(128, 1, 64, 256, 256, false), sm90);  // 128 tiles: half a wave
  if (sm90_config(DType::kBFloat16, 64)) {
    EXPECT_EQ(family(64, 1, 8, 1024, 1024, false), sm90);
    EXPECT_EQ(family(64, 1, 4, 768, 768, true), sm90);
    EXPECT_EQ(family(64, 1, 8, 640, 640, true), sm80);
    EXPECT_EQ(family(64, 1, 8, 512, 512, true), sm80);
  }
  if (sm90_config(DType::kBFloat16, 96)) {
    EXPECT_EQ(family(96, 1, 8, 256, 256, true), sm90);
    EXPECT_EQ(family(96, 1, 8, 128, 128, false), sm80);  // not measured below 256
  }
  if (sm90_config(DType::kBFloat16, 256)) {
    EXPECT_EQ(family(256, 1, 4, 256, 256, false), sm90);
  }
  if (sm90_config(DType::kBFloat16, 32)) {
    EXPECT_EQ(family(32, 1, 4, 1024, 1024, false), sm80);
  }
}

// d=128 block_n: 176 (one Q buffer) only for long non-causal problems, both lengths >= 8k;
// Sq1k/Sk8k keeps 128 (H100: 586-624 vs 683-685 TFLOPS, kernels-sm90-h100-2026-11-24-c.md);
// d=64 keeps 128 although 192 is compiled.
TEST(Sm90Dispatch, BlockNFollowsTheMeasuredRule) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 128);
  auto block_n = [](int d, int sq, int sk, bool causal) {
    AttentionParams p =
        make_contiguous_params(DType::kBFloat16, 4, sq, sk, 16, 16, d, causal, 0.1f);
    alignas(16) static char dummy[16];  // select() looks at the layout, never at the data
    p.q = p.k = p.v = p.o = dummy;
    const fk::KernelConfig c = fk::select(p, 132);
    EXPECT_EQ(c.family, fk::KernelFamily::kSm90) << d << " " << sq << " " << sk;
    return c.block_n;
  };
  EXPECT_EQ(block_n(128, 8192, 8192, false), 176);
  EXPECT_EQ(block_n(128, 16384, 16384, false), 176);
  EXPECT_EQ(block_n(128, 1024, 8192, false), 128);
  EXPECT_EQ(block_n(128, 8192, 8192, true), 128);
  EXPECT_EQ(block_n(128, 4096, 4096, false), 128);
  if (sm90_config(DType::kBFloat16, 64)) {
    EXPECT_EQ(block_n(64, 8192, 8192, false), 128);
  }
}

// d=64 takes 192-row tiles (three consumer warpgroups) where the A/B measured them ahead:
// non-causal, causal from S768 (H200, end-aligned causal tiles), and only with 4+ waves of tiles.
TEST(Sm90Dispatch, BlockM192FollowsTheMeasuredRule) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 64);
  auto block_m = [](int b, int s, int h, bool causal) {
    AttentionParams p = make_contiguous_params(DType::kBFloat16, b, s, s, h, h, 64, causal, 0.1f);
    alignas(16) static char dummy[16];  // select() looks at the layout, never at the data
    p.q = p.k = p.v = p.o = dummy;
    const fk::KernelConfig c = fk::select(p, 132);
    EXPECT_EQ(c.family, fk::KernelFamily::kSm90) << b << " " << s << " " << h << " " << causal;
    return c.block_m;
  };
  EXPECT_EQ(block_m(16, 1024, 32, false), 192);
  EXPECT_EQ(block_m(4, 16384, 32, false), 192);
  EXPECT_EQ(block_m(16, 2048, 32, true), 192);
  EXPECT_EQ(block_m(16, 2000, 32, true), 192);
  EXPECT_EQ(block_m(16, 1000, 32, true), 192);
  EXPECT_EQ(block_m(16, 768, 32, true), 192);
  EXPECT_EQ(block_m(16, 767, 32, true), 128);  // shorter causal: S512 measured behind
  EXPECT_EQ(block_m(16, 512, 32, true), 128);
  EXPECT_EQ(block_m(1, 1024, 16, false), 128);  // 96 tiles of 192 rows: under one wave
}

// The causal tile order (kernels/cuda/sm90/tile_order.h): every (query tile, batch * head) exactly
// once, including a last section with fewer heads; inside a section the query tiles go in order
// (the kernel reverses them: heaviest first) with the heads innermost; sections of 1 head are the
// old order. Host arithmetic only: runs without a GPU.
TEST(Sm90TileOrder, SectionsArePermutationsWalkedTileByTile) {
  namespace s9 = fk::sm90;
  struct OrderCase { int num_m, num_hb, l2_heads; };
  for (const OrderCase c : {OrderCase{32, 256, 16}, OrderCase{3, 10, 4}, OrderCase{5, 7, 7},
                            OrderCase{1, 5, 3}, OrderCase{9, 13, 100}, OrderCase{4, 6, 1},
                            OrderCase{4, 6, 0}}) {
    std::vector<int> seen(size_t(c.num_m) * c.num_hb, 0);
    int prev_m = -1, prev_section = -1;
    for (int t = 0; t < c.num_m * c.num_hb; ++t) {
      const s9::TileCoord tc = s9::tile_coord(t, c.num_m, c.num_hb, c.l2_heads);
      ASSERT_TRUE(tc.m_idx >= 0 && tc.m_idx < c.num_m && tc.hb >= 0 && tc.hb < c.num_hb)
          << c.num_m << " " << c.num_hb << " " << c.l2_heads << " tile " << t;
      ++seen[size_t(tc.hb) * c.num_m + tc.m_idx];
      if (c.l2_heads <= 1) {
        EXPECT_EQ(tc.m_idx, t % c.num_m);
        EXPECT_EQ(tc.hb, t / c.num_m);
        continue;
      }
      const int section = tc.hb / c.l2_heads;
      EXPECT_GE(section, prev_section);  // sections one after the other
      if (section == prev_section) {
        EXPECT_GE(tc.m_idx, prev_m);  // query tile by query tile
      }
      prev_section = section;
      prev_m = tc.m_idx;
    }
    for (size_t i = 0; i < seen.size(); ++i)
      EXPECT_EQ(seen[i], 1) << c.num_m << " " << c.num_hb << " " << c.l2_heads << " at " << i;
  }
  // 32 MB sections: d128 bf16 S4096 has 2 MB of K/V per head -> 16 heads; 4 query heads per K/V
  // head -> 64; at least 1 (S256k), at most every head.
  EXPECT_EQ(s9::l2_section_heads(4096, 128, 2, 1, 256), 16);
  EXPECT_EQ(s9::l2_section_heads(4096, 128, 2, 4, 512), 64);
  EXPECT_EQ(s9::l2_section_heads(262144, 128, 2, 1, 256), 1);
  EXPECT_EQ(s9::l2_section_heads(1024, 64, 2, 1, 12), 12);
  // Used only for causal problems at head_dim >= 128 (H100 A/B: d64 causal lost 1-2% with it).
  EXPECT_EQ(s9::schedule_l2_section_heads(true, 4096, 128, 2, 1, 256), 16);
  EXPECT_EQ(s9::schedule_l2_section_heads(true, 4096, 256, 2, 1, 256), 8);
  EXPECT_EQ(s9::schedule_l2_section_heads(false, 4096, 128, 2, 1, 256), 0);
  EXPECT_EQ(s9::schedule_l2_section_heads(true, 4096, 64, 2, 1, 512), 0);
}

// The dynamic (causal) schedule counts tiles on a counter slot (kernels/cuda/sm90/scheduler.h)
// that stays with its stream, and each launch's last block resets it: 2100 launches on one
// stream reuse one slot, and a slot left dirty would skip tiles and leave the poisoned output in
// place. Runs of the same problem must also match bit for bit.
TEST(Sm90Schedule, CausalSlotsAreReusedCleanly) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 128);
  Param prm{DType::kBFloat16, 128, {2, 300, 300, 4, 2, true, 1.f}};
  const Problem pr = make_problem(prm);
  const fk::KernelConfig cfg = *sm90_config(DType::kBFloat16, 128);
  tu::DeviceProblem dev(pr.p);
  ASSERT_EQ(dev.upload(pr.p), cudaSuccess);
  const AttentionParams p = dev.params(pr.p, false);
  auto run_poisoned = [&](std::vector<uint16_t>* out) {
    ASSERT_EQ(dev.o.poison(), cudaSuccess);
    ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
    out->resize(tu::q_elements(pr.p));
    ASSERT_EQ(dev.o.download(out), cudaSuccess);
  };
  std::vector<uint16_t> first, again;
  ASSERT_NO_FATAL_FAILURE(run_poisoned(&first));
  ASSERT_TRUE(tu::all_finite(tu::to_double(p.dtype, first)));
  for (int i = 1; i <= 2100; ++i) {
    if (i % 100 == 0) {
      ASSERT_NO_FATAL_FAILURE(run_poisoned(&again));
      ASSERT_TRUE(again == first) << "launch " << i << " differs from the first";
    } else {
      ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// A dynamic launch's counter slot stays with its stream while the launch is pending: stream A's
// causal launch waits behind a gate while stream B runs 1100 causal launches, each to
// completion; none of B's may take A's slot (the round-robin slots before session 27 handed B
// A's slot at its 1024th launch: with A running, both would have taken tiles from one counter).
// Both answers must match an ungated run bit for bit.
TEST(Sm90Schedule, PendingLaunchKeepsItsSlot) {
  SKIP_WITHOUT_SM90(DType::kBFloat16, 128);
  Param prm{DType::kBFloat16, 128, {2, 300, 300, 4, 2, true, 1.f}};
  const Problem pr = make_problem(prm);
  const fk::KernelConfig cfg = *sm90_config(DType::kBFloat16, 128);
  tu::DeviceProblem dev_a(pr.p), dev_b(pr.p);
  ASSERT_EQ(dev_a.upload(pr.p), cudaSuccess);
  ASSERT_EQ(dev_b.upload(pr.p), cudaSuccess);
  const AttentionParams pa = dev_a.params(pr.p, false), pb = dev_b.params(pr.p, false);
  cudaStream_t a = nullptr, b = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  auto output = [&](tu::DeviceProblem& dev, std::vector<uint16_t>* out) {
    out->resize(tu::q_elements(pr.p));
    ASSERT_EQ(dev.o.download(out), cudaSuccess);
  };
  std::vector<uint16_t> ungated, got_a, got_b;
  ASSERT_EQ(fk::run(pb, cfg, b), cudaSuccess);  // loads the kernel before any gate
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(output(dev_b, &ungated));
  ASSERT_TRUE(tu::all_finite(tu::to_double(pb.dtype, ungated)));
  ASSERT_EQ(dev_a.poison(), cudaSuccess);
  bool serialized = false;
  {
    tu::StreamGate gate(a);
    ASSERT_EQ(fk::run(pa, cfg, a), cudaSuccess);
    const int a_slot = fk::last_counter_slot();
    ASSERT_GE(a_slot, 0) << "the causal launch took the dynamic schedule";
    for (int i = 0; i < 1100; ++i) {
      ASSERT_EQ(dev_b.o.poison(), cudaSuccess);
      ASSERT_EQ(fk::run(pb, cfg, b), cudaSuccess);
      ASSERT_NE(fk::last_counter_slot(), a_slot) << "launch " << i << " of stream B";
      ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
    }
    serialized = gate.opened_by_itself();
  }
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(output(dev_a, &got_a));
  ASSERT_NO_FATAL_FAILURE(output(dev_b, &got_b));
  EXPECT_TRUE(got_a == ungated) << "stream A's answer";
  EXPECT_TRUE(got_b == ungated) << "stream B's last answer";
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
  if (serialized)
    GTEST_SKIP() << "stream B ran only once gated stream A's gate timed out: "
                    "launches are serialized here (a sanitizer?), nothing was tested";
}

// Needs no GPU: the sm90 names parse back and differ from every sm80 name.
TEST(Sm90Dispatch, ConfigNamesRoundTrip) {
  const fk::KernelConfig c = fk::KernelConfig::sm90(128, 2);
  EXPECT_EQ(c.name(), "sm90m128n128w12s2l");
  const auto parsed = fk::KernelConfig::parse(c.name());
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(*parsed, c);
  EXPECT_EQ(parsed->family, fk::KernelFamily::kSm90);
  EXPECT_NE(*fk::KernelConfig::parse("m128n128w12s2l"), c);
  EXPECT_FALSE(fk::KernelConfig::parse("sm90").has_value());
  EXPECT_FALSE(fk::KernelConfig::parse("sm9m128n128w12s2l").has_value());
  // Three consumer warpgroups (block_m 192) count the producer's warps too.
  const fk::KernelConfig m192 = fk::KernelConfig::sm90(128, 2, 192);
  EXPECT_EQ(m192.name(), "sm90m192n128w16s2l");
  EXPECT_EQ(fk::KernelConfig::parse(m192.name()), m192);
  EXPECT_NE(m192, c);
}

}  // namespace
}  // namespace flashserve::kernels
