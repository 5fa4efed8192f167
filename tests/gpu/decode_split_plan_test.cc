// The split-KV decode kernels' split plan (decode_num_splits, decode_split_candidates) and its
// workspace: how many key-axis splits each layout, head dim, batch and key length gets, on 132 SMs
// (kernels/cuda/decode/decode_dispatch.cu; measurements behind each count in
// bench/results/kernels-decode-h200-2026-11-30-split-tiers.md and the files it names). Answers
// only, no kernel runs: the kernels' correctness is decode_attention_test.cc. Tests that read the
// kernels' occupancy skip without a GPU, and the sm_90 plans skip below sm_90.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "flashserve/kernels/decode_attention.h"
#include "gpu_test_support.h"

namespace flashserve::kernels::cuda::decode {
int& wide_tiles_override();  // kernels/cuda/decode/decode_dispatch.cu (benchmarking knob)
}  // namespace flashserve::kernels::cuda::decode

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

// decode_num_splits on 132 SMs for a bf16 decode step (32 query heads, Sq 1) over `batch`
// sequences of `keys` keys, dense (page_size 0) or paged.
int planned_splits(int head_dim, int heads_kv, int batch, int keys, int page_size) {
  static const int32_t kMarker = 0;
  fk::DecodeParams p = fk::make_dense_decode_params(DType::kBFloat16, batch, 1, keys, 32, heads_kv,
                                                    head_dim, false, 0.1f);
  if (page_size > 0) p.block_table = &kMarker, p.page_size = page_size;
  return fk::decode_num_splits(p, 132);
}

TEST(DecodeAttentionApi, WorkspaceBytes) {
  fk::DecodeParams p =
      fk::make_dense_decode_params(DType::kBFloat16, 3, 2, 100, 8, 2, 128, false, 0.1f);
  EXPECT_EQ(fk::decode_workspace_bytes(p, 1), 0u);
  // 4 splits x 6 rows x 8 heads: O 128 floats each, LSE one float each (256-byte aligned).
  EXPECT_EQ(fk::decode_workspace_bytes(p, 4), size_t(4 * 6 * 8 * 128 * 4) + 768u);
}

// Runs everywhere: without a GPU the kernels' occupancy reads as one block per SM.
TEST(DecodeAttentionApi, SplitCandidates) {
  fk::DecodeParams p =
      fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 131072, 32, 8, 128, false, 0.1f);
  const std::vector<int> c = fk::decode_split_candidates(p, 132);
  ASSERT_FALSE(c.empty());
  EXPECT_EQ(c.front(), 1);
  EXPECT_TRUE(std::is_sorted(c.begin(), c.end()));
  EXPECT_EQ(std::adjacent_find(c.begin(), c.end()), c.end()) << "duplicates";
  EXPECT_NE(std::find(c.begin(), c.end(), fk::decode_num_splits(p, 132)), c.end());
  EXPECT_LE(c.back(), 128);
  EXPECT_GE(c.size(), 3u);  // 1, and the 1- and 2-wave counts (17 or 33, 33 or 66 here)
  p.seqlen_k = 100;         // two key tiles: at most two splits
  for (int s : fk::decode_split_candidates(p, 132)) EXPECT_LE(s, 2);
}

// The tile width sets how many splits a sequence can take (at least two key tiles each): 256 keys
// are two 128-key tiles of the d64 16-row kernel (dense: the default), four of 64 keys.
TEST(DecodeAttentionApi, TileWidthSetsTheSplitLimit) {
  const fk::DecodeParams p =
      fk::make_dense_decode_params(DType::kFloat16, 1, 1, 256, 32, 32, 64, false, 0.1f);
  EXPECT_EQ(fk::decode_num_splits(p, 132), 1);
  for (int s : fk::decode_split_candidates(p, 132)) EXPECT_LE(s, 2);
  fk::decode::wide_tiles_override() = 0;
  EXPECT_EQ(fk::decode_num_splits(p, 132), 2);
  for (int s : fk::decode_split_candidates(p, 132)) EXPECT_LE(s, 4);
  fk::decode::wide_tiles_override() = -1;  // the default again (EXPECTs only: always reached)
}

TEST(DecodeAttentionApi, SplitHeuristicFillsTheGpu) {
  SKIP_WITHOUT_GPU();  // reads the kernels' occupancy
  // One sequence, 128k keys, 8 KV heads on 132 SMs: many splits; 64 x 8k x 8 heads: few.
  fk::DecodeParams p =
      fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 131072, 32, 8, 128, false, 0.1f);
  const int long_one = fk::decode_num_splits(p, 132);
  EXPECT_GE(long_one, 16);
  EXPECT_LE(long_one, 128);
  p = fk::make_dense_decode_params(DType::kBFloat16, 64, 1, 8192, 32, 8, 128, false, 0.1f);
  EXPECT_LE(fk::decode_num_splits(p, 132), 2);
  p = fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 64, 32, 8, 128, false, 0.1f);
  EXPECT_EQ(fk::decode_num_splits(p, 132), 1);  // one tile: nothing to split
}

// A grid that already covers most SMs is left whole (decode_dispatch.cu, grid_left_whole): from 90%
// of the SMs, or from 70% with <= 4096 keys, on dense K/V and pages >= 64; pages of 16, fewer
// blocks and longer keys at 70-90% keep the wave plan. Runs everywhere (no occupancy read).
TEST(DecodeAttentionApi, SplitPlanLeavesAFullGridWhole) {
  const auto splits = planned_splits;
  for (int page : {0, 64}) {
    SCOPED_TRACE("page " + std::to_string(page));
    EXPECT_EQ(splits(128, 8, 20, 4096, page), 1) << "d128 GQA, 160 blocks";
    EXPECT_EQ(splits(128, 8, 20, 16384, page), 1) << "d128 GQA, 160 blocks";
    EXPECT_EQ(splits(128, 8, 12, 4096, page), 1) << "d128 GQA, 96 blocks, short";
    EXPECT_EQ(splits(128, 32, 3, 4096, page), 1) << "d128 MHA, 96 blocks, short";
    EXPECT_EQ(splits(64, 32, 3, 1024, page), 1) << "d64 MHA, 96 blocks, short";
    EXPECT_EQ(splits(64, 8, 12, 4096, page), 1) << "d64 GQA, 96 blocks, short";
    EXPECT_GT(splits(128, 8, 12, 16384, page), 1) << "d128 GQA, 96 blocks, long";
    EXPECT_GT(splits(64, 32, 3, 16384, page), 1) << "d64 MHA, 96 blocks, long";
    EXPECT_GT(splits(64, 32, 2, 4096, page), 1) << "d64 MHA, 64 blocks";
    EXPECT_GT(splits(128, 8, 8, 4096, page), 1) << "d128 GQA, 64 blocks";
  }
  EXPECT_GT(splits(64, 32, 3, 4096, 16), 1) << "pages of 16 keep the plan";
  // (d128 on pages of 16: SplitPlanFillsOneWaveOnSmallPages)
}

// On pages of 16 the d128 16-row kernel (two blocks per SM) splits into one wave of resident
// blocks when that wave fills >= 70% of the slots (decode_dispatch.cu, one_wave_splits).
TEST(DecodeAttentionApi, SplitPlanFillsOneWaveOnSmallPages) {
  SKIP_WITHOUT_GPU();  // reads the kernels' occupancy
  auto splits = [](int heads_kv, int batch, int keys) {
    return planned_splits(128, heads_kv, batch, keys, 16);
  };
  EXPECT_EQ(splits(8, 12, 4096), 2) << "96 blocks: 192 in one wave";
  EXPECT_EQ(splits(8, 12, 16384), 2);
  EXPECT_EQ(splits(32, 3, 4096), 2) << "MHA, 96 blocks";
  EXPECT_EQ(splits(8, 8, 4096), 4) << "64 blocks: 256";
  EXPECT_EQ(splits(8, 32, 4096), 1) << "256 blocks: one wave unsplit";
  EXPECT_GT(splits(8, 20, 16384), 1) << "160 blocks: a 61% wave, the plan splits";
}

// sm_90's d128 16-row kernel on whole-tile TMA boxes (dense K/V, pages of 64) plans its split
// count by SM tiers (decode_dispatch.cu, sm_tier_splits): one block per SM up to the SM count,
// beyond it two per SM in waves; a grid on >= 80% of the SMs splits only where its waves end
// ragged, into blocks of >= 2048 keys (1024 where the unsplit grid leaves SMs idle).
TEST(DecodeAttentionApi, SplitPlanCountsSmTiers) {
  SKIP_WITHOUT_GPU();  // reads the kernels' occupancy
  if (tu::device_compute_major() < 9) GTEST_SKIP() << "the tiers are for sm_90's TMA path";
  auto splits = [](int heads_kv, int batch, int keys, int page_size) {
    return planned_splits(128, heads_kv, batch, keys, page_size);
  };
  for (int page : {0, 64}) {
    SCOPED_TRACE("page " + std::to_string(page));
    EXPECT_EQ(splits(8, 8, 4096, page), 2) << "64 blocks: 128, one per SM";
    EXPECT_EQ(splits(8, 1, 131072, page), 16) << "8 blocks: 128, one per SM";
    EXPECT_EQ(splits(8, 12, 4096, page), 1) << "96 blocks: no fuller grid of >= 1024 keys";
    EXPECT_EQ(splits(8, 12, 8192, page), 8) << "96 blocks: 768 of 1024 keys, 2.9 waves of 264";
    EXPECT_EQ(splits(8, 12, 16384, page), 8);
    EXPECT_EQ(splits(32, 3, 4096, page), 1) << "MHA, 96 blocks, short";
    EXPECT_EQ(splits(8, 14, 8192, page), 1) << "112 blocks: 85% of the SMs, unsplit";
    EXPECT_EQ(splits(8, 10, 16384, page), 13) << "80 blocks: 1040 of 1260 keys, 3.9 waves";
    EXPECT_EQ(splits(8, 20, 8192, page), 1) << "160 blocks: 61% of one wave, not ragged enough";
    EXPECT_EQ(splits(8, 24, 16384, page), 4) << "192 blocks (73%): 768";
    EXPECT_EQ(splits(8, 24, 4096, page), 1) << "192 blocks: splits would be < 2048 keys";
    EXPECT_EQ(splits(8, 32, 16384, page), 1) << "256 blocks: a 97% wave";
    EXPECT_EQ(splits(8, 40, 16384, page), 4) << "320 blocks (1.2 waves): 1280";
    EXPECT_EQ(splits(8, 48, 16384, page), 2) << "384 blocks (1.45 waves): 768";
    EXPECT_EQ(splits(8, 64, 8192, page), 1) << "512 blocks: 1.94 waves";
    EXPECT_EQ(splits(8, 100, 8192, page), 1) << "800 blocks: from 3 waves unsplit";
  }
  EXPECT_EQ(splits(8, 24, 16384, 16), 1) << "pages of 16: one wave of two per SM (one_wave_splits)";
  // 16 rows per block (GQA 32:8, Sq 4): splits of >= 4096 keys past the SM count.
  fk::DecodeParams sq4 =
      fk::make_dense_decode_params(DType::kBFloat16, 24, 4, 8192, 32, 8, 128, false, 0.1f);
  EXPECT_EQ(fk::decode_num_splits(sq4, 132), 1) << "192 blocks, 2 splits of 4096: no fuller";
  sq4.seqlen_k = 16384;
  EXPECT_EQ(fk::decode_num_splits(sq4, 132), 4) << "192 blocks, 4 splits of 4096: 768";
}

// sm_90's d64 128-key kernels plan by the same tiers, counting each split with its own depth:
// splits of >= 4096 keys run the 2-stage kernel, three per SM, two of which keep it at full speed.
TEST(DecodeAttentionApi, SplitPlanCountsTiersByDepthAtD64) {
  SKIP_WITHOUT_GPU();  // reads the kernels' occupancy
  if (tu::device_compute_major() < 9) GTEST_SKIP() << "the tiers are for sm_90's TMA path";
  auto splits = [](int heads_kv, int batch, int keys, int page_size) {
    return planned_splits(64, heads_kv, batch, keys, page_size);
  };
  for (int page : {0, 64}) {
    SCOPED_TRACE("page " + std::to_string(page));
    EXPECT_EQ(splits(32, 2, 4096, page), 2) << "64 blocks: 128 3-stage, one per SM";
    EXPECT_EQ(splits(32, 2, 16384, page), 4) << "64 blocks: 256 2-stage, two per SM";
    EXPECT_EQ(splits(32, 1, 131072, page), 8) << "32 blocks: 256 2-stage";
    EXPECT_EQ(splits(32, 3, 16384, page), 4) << "96 blocks: 384 2-stage, one wave of 396";
    EXPECT_EQ(splits(32, 4, 16384, page), 1) << "128 blocks: 97% of the SMs";
    EXPECT_EQ(splits(32, 5, 16384, page), 1) << "160 blocks: 61% of one wave";
    EXPECT_EQ(splits(32, 8, 16384, page), 1) << "256 blocks: a 97% wave";
    EXPECT_EQ(splits(32, 9, 16384, page), 4) << "288 blocks: 1152 2-stage, 2.9 waves of 396";
    EXPECT_EQ(splits(32, 10, 16384, page), 2) << "320 blocks: 640 2-stage, 1.6 waves of 396";
    EXPECT_EQ(splits(32, 10, 65536, page), 6) << "320 blocks: 1920 2-stage";
    EXPECT_EQ(splits(32, 12, 4096, page), 1) << "384 blocks: no split of >= 4096 keys";
    EXPECT_EQ(splits(32, 20, 16384, page), 3) << "640 blocks: 1920 2-stage";
    EXPECT_EQ(splits(8, 40, 16384, page), 2) << "GQA 32:8, 320 blocks";
  }
  EXPECT_EQ(splits(32, 10, 16384, 16), 4) << "pages of 16 (64-key kernel): the wave plan";
}

// The split plan depends on the layout (so must a workspace): on sm_90+ the d128 decode kernel on
// whole-tile TMA boxes (dense K/V, pages of 64) plans one block per SM, pages of 16 and d64 two.
TEST(DecodeAttentionApi, SplitPlanFollowsTheLayout) {
  SKIP_WITHOUT_GPU();
  if (tu::device_compute_major() < 9)
    GTEST_SKIP() << "the one-block-per-SM plan is for sm_90's TMA path";
  static const int32_t kMarker = 0;
  auto splits = [](fk::DecodeParams p, int page_size) {
    if (page_size > 0) p.block_table = &kMarker, p.page_size = page_size;
    return fk::decode_num_splits(p, 132);
  };
  const fk::DecodeParams d128 =
      fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 131072, 32, 8, 128, false, 0.1f);
  for (int page : {0, 64, 256}) {
    SCOPED_TRACE("d128, page " + std::to_string(page));
    EXPECT_LE(8 * splits(d128, page), 132);  // 8 KV heads x splits blocks: one per SM
    EXPECT_GE(8 * splits(d128, page), 120);
  }
  EXPECT_GT(8 * splits(d128, 16), 132) << "pages of 16: two blocks per SM";
  EXPECT_GT(8 * splits(d128, 48), 132) << "pages of 48 (cp.async): two blocks per SM";
  fk::DecodeParams varlen_k = d128;  // dense K/V packed by cu_seqlens_k: cp.async, two per SM
  varlen_k.cu_seqlens_k = &kMarker;
  EXPECT_GT(8 * splits(varlen_k, 0), 132) << "packed varlen K/V: two blocks per SM";
  const fk::DecodeParams d64 =
      fk::make_dense_decode_params(DType::kBFloat16, 1, 1, 131072, 32, 32, 64, false, 0.1f);
  EXPECT_GT(32 * splits(d64, 64), 132) << "d64: two blocks per SM";
}

}  // namespace
}  // namespace flashserve::kernels
