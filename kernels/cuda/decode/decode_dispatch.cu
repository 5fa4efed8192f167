// Runtime -> compile-time dispatch of the decode kernels: the table of compiled split kernels,
// decode_supported(), the split heuristic, workspace sizing and run_decode().
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "decode_merge_plan.h"
#include "decode_tensor_map.h"
#include "decode_traits.h"
#include "flashserve/kernels/decode_attention.h"

namespace flashserve::kernels::cuda::decode {
FLASHSERVE_DECODE_INSTANCES(extern, 32)
FLASHSERVE_DECODE_INSTANCES(extern, 64)
FLASHSERVE_DECODE_INSTANCES(extern, 96)
FLASHSERVE_DECODE_INSTANCES(extern, 128)
FLASHSERVE_DECODE_INSTANCES(extern, 256)
FLASHSERVE_DECODE_WIDE_INSTANCES(extern)
}  // namespace flashserve::kernels::cuda::decode

namespace flashserve::kernels::cuda {
namespace decode {
int& l2_prefetch_override() {
  static int value = -1;
  return value;
}
int& copy_override() {
  static int value = -1;
  return value;
}
int& pdl_override() {
  static int value = -1;
  return value;
}
int& tma_wide_override() {
  static int value = -1;
  return value;
}
int& wide_tiles_override() {
  static int value = -1;
  return value;
}
int& last_copy() {
  thread_local int value = -1;
  return value;
}
int& last_block_n() {
  thread_local int value = 0;
  return value;
}
int& last_stages() {
  thread_local int value = 0;
  return value;
}
int& deep_issue_override() {
  static int value = -1;
  return value;
}
int& fused_merge_override() {
  static int value = -1;
  return value;
}
int& last_merge() {
  thread_local int value = 0;
  return value;
}
}  // namespace decode

namespace {

using decode::DecodeKernel;
using decode::DecodeLaunch;

constexpr int kHeadDims[] = {32, 64, 96, 128, 256};
constexpr int kMaxSplits = 128;
constexpr int kMaxGridYZ = 65535;
// Keys per tile are the selected kernel's (DecodeKernel::block_n): 64 for the 16/32-row kernels,
// 32 for the 64-row ones, 128 for the d64 16-row kernel where wide_stages picks it.
constexpr int kMinTilesPerSplit = 2;  // shorter splits spend more on prologue and partials
// The d64 16-row kernel on 128-key tiles (2 or 3 stages): where and why, wide_stages below.
constexpr int kWideBlockN = 128;
constexpr int kWidePage = 64;         // smallest page it reads when the key axis is split
constexpr int kLongSplitKeys = 4096;  // splits this long take 2 stages
constexpr int kShortGridKeys = 4096;  // grid_left_whole: at 70-90% of the SMs, up to this many keys
// sm_tier_splits: key tiles per block of a split grid past the SM count, where the unsplit grid
// leaves SMs idle / already fills them (d128: 1024 / 2048 keys, d64 on 128-key tiles: 2048 / 4096).
constexpr int kMinTilesPastSms = 16;
constexpr int kMinTilesPastFullGrid = 32;
// Programmatic dependent launch on sm_90+ (see decode::pdl_wait_then_release): the combine's
// launch overlaps the split kernel (H100: B1 Sk128k 0.203 -> 0.200 ms; elsewhere even).
constexpr bool kPdlByDefault = true;
// K/V copy on sm_90+ when the knob is unset: 2, TMA boxes (decode_tma.h; problems it cannot
// load use cp.async) where default_copy_sm90 says they pay. H100 runs 7-8: 1.015-1.18x the
// cp.async path on every measured shape with 64-column slices.
constexpr int kDefaultCopySm90 = 2;

template <typename Element, int kHeadDim>
DecodeKernel kernel_for_rows(int rows) {
  if (rows <= 16) return decode::decode_kernel<Element, kHeadDim, 1>();
  if (rows <= 32) return decode::decode_kernel<Element, kHeadDim, 2>();
  return decode::decode_kernel<Element, kHeadDim, 4>();
}

template <typename Element>
DecodeKernel kernel_for(int head_dim, int rows) {
  switch (head_dim) {
    case 32: return kernel_for_rows<Element, 32>(rows);
    case 64: return kernel_for_rows<Element, 64>(rows);
    case 96: return kernel_for_rows<Element, 96>(rows);
    case 128: return kernel_for_rows<Element, 128>(rows);
    case 256: return kernel_for_rows<Element, 256>(rows);
    default: return DecodeKernel{};
  }
}

/// The d64 16-row kernel on 128-key tiles with `stages` (2 or 3) pipeline stages.
template <typename Element>
DecodeKernel wide_kernel(int stages) {
  return stages == 2 ? decode::decode_kernel<Element, 64, 1, kWideBlockN, 2>()
                     : decode::decode_kernel<Element, 64, 1, kWideBlockN, 3>();
}

/// The split kernel for p on sm_count SMs (defined below, after the split plan it uses).
DecodeKernel select_kernel(const DecodeParams& p, int sm_count);

/// Key tiles of the longest sequence (p.seqlen_k, at least one key) for k's tile width.
int key_tiles(const DecodeParams& p, const DecodeKernel& k) {
  return (std::max(p.seqlen_k, 1) + k.block_n - 1) / k.block_n;
}

int row_blocks(const DecodeParams& p, const DecodeKernel& k) {
  const int rows = (p.heads_q / p.heads_kv) * std::max(p.seqlen_q, 1);
  return (rows + k.block_m - 1) / k.block_m;
}

int total_q_rows(const DecodeParams& p) {
  return p.cu_seqlens_q != nullptr ? p.total_q : p.batch * p.seqlen_q;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The workspace alignment the header promises. The partials need 16 (float4 stores, 16-byte
// cp.async in the merge); 256 is what cudaMalloc and every caller already give.
constexpr uintptr_t kWorkspaceAlignment = 256;

std::string check_strides(const char* name, int64_t batch, int64_t row, int64_t head) {
  if (batch % 8 != 0 || row % 8 != 0 || head % 8 != 0)
    return std::string(name) + " strides must be multiples of 8 elements (16 bytes)";
  return "";
}

std::string check_paging(const DecodeParams& p) {
  if (p.block_table == nullptr) return "";
  if (p.seqlens_k == nullptr) return "paged K/V needs seqlens_k";
  if (p.cu_seqlens_k != nullptr) return "cu_seqlens_k is for dense K/V; paged K/V uses seqlens_k";
  if (p.page_size < 1) return "page_size must be >= 1";
  if (p.block_table_stride < 1) return "block_table_stride must be >= 1";
  // The kernels read block_table[b * stride + key / page_size] for every key < Sk_b unbounded:
  // a length past one row's pages reads the next sequence's entries.
  if ((int64_t{p.seqlen_k} + p.page_size - 1) / p.page_size > p.block_table_stride)
    return "seqlen_k must be <= block_table_stride * page_size (the keys one table row addresses)";
  return "";
}

std::string check_sizes(const DecodeParams& p) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.total_q < 0)
    return "sizes must be >= 0";
  if (p.heads_q < 1 || p.heads_kv < 1) return "heads_q and heads_kv must be >= 1";
  if (p.heads_q % p.heads_kv != 0) return "heads_q must be a multiple of heads_kv";
  if (p.cu_seqlens_q == nullptr && int64_t{p.batch} * p.seqlen_q > INT32_MAX)
    return "batch * seqlen_q must fit in int32";
  // Packed: seqlen_q bounds every sequence's rows; the row blocks, the kernel and the in-kernel
  // merge's shared memory are sized from it (a smaller bound leaves rows unwritten or overruns).
  if (p.cu_seqlens_q != nullptr && p.total_q > 0 &&
      (p.seqlen_q < 1 || p.total_q > int64_t{p.batch} * p.seqlen_q))
    return "seqlen_q must bound every packed sequence's rows (>= 1, batch * seqlen_q >= total_q)";
  if (int64_t{p.heads_q / p.heads_kv} * p.seqlen_q > INT32_MAX / 2) return "seqlen_q too large";
  if (p.batch > kMaxGridYZ) return "batch must be <= 65535";
  if (p.num_splits < 0 || p.num_splits > kMaxSplits) return "num_splits must be in 0..128";
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale))
    return "softmax_scale must be a positive finite number";
  return "";
}

int sm_count_of_current_device() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 1;
  return std::max(sms, 1);
}

/// Compute capability major of the current device (0 on error).
int device_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return 0;
  return major;
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

/// The K/V copy of p when the knob is unset (sm_90+). TMA slices of 32 columns (d32, d96; only
/// the 16-row kernels have them, DecodeTraits::kHasTma) where they beat cp.async (H200, session
/// 25, kernels-decode-h200-2026-11-29-slices.md): 1.05-1.21x on dense K/V and pages of 64, d96
/// pages of 16 1.15-1.19x; d32 pages of 16 0.96-0.99x (32 not measured: pages < 64 keep cp.async).
int default_copy_sm90(const DecodeParams& p) {
  if (p.head_dim == 32 && p.block_table != nullptr && p.page_size < 64) return 0;
  return kDefaultCopySm90;
}

/// Fills L's TMA fields for p; false (cp.async then) when the TMA path cannot load p. A kernel
/// built without sm_90 code ignores them (decode_kernel.h selects the pipe per architecture).
bool setup_tma(const DecodeParams& p, const DecodeKernel& k, DecodeLaunch* L) {
  if (!k.has_tma) return false;
  L->tma_rows = decode::tma_box_rows(p, k.block_n);
  L->tma_wide = decode::tma_wide_override() == 1 && L->tma_rows == k.block_n;
  return L->tma_rows > 0 &&
         decode::make_kv_tensor_map(p, false, L->tma_rows, L->tma_wide, L->l2_prefetch, &L->tma_k) &&
         decode::make_kv_tensor_map(p, true, L->tma_rows, L->tma_wide, L->l2_prefetch, &L->tma_v);
}

}  // namespace

DecodeParams make_dense_decode_params(DType dtype, int batch, int seqlen_q, int seqlen_k,
                                      int heads_q, int heads_kv, int head_dim, bool causal,
                                      float softmax_scale) {
  DecodeParams p;
  p.dtype = dtype;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.head_dim = head_dim;
  p.causal = causal;
  p.softmax_scale = softmax_scale;
  p.q_head_stride = p.o_head_stride = head_dim;
  p.q_row_stride = p.o_row_stride = int64_t{heads_q} * head_dim;
  p.q_batch_stride = p.o_batch_stride = p.q_row_stride * seqlen_q;
  p.k_head_stride = p.v_head_stride = head_dim;
  p.k_row_stride = p.v_row_stride = int64_t{heads_kv} * head_dim;
  p.k_batch_stride = p.v_batch_stride = p.k_row_stride * seqlen_k;
  return p;
}

std::vector<int> decode_head_dims() { return std::vector<int>(std::begin(kHeadDims), std::end(kHeadDims)); }

std::string decode_supported(const DecodeParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16)
    return "decode kernels support fp16 and bf16 only";
  if (std::find(std::begin(kHeadDims), std::end(kHeadDims), p.head_dim) == std::end(kHeadDims))
    return "head_dim " + std::to_string(p.head_dim) +
           " is not supported by the decode kernels (supported: 32, 64, 96, 128, 256)";
  if (std::string s = check_sizes(p); !s.empty()) return s;
  if (std::string s = check_paging(p); !s.empty()) return s;
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr)
    return "q, k, v and o must be set";
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return "q, k, v and o must be 16-byte aligned";
  if (reinterpret_cast<uintptr_t>(p.workspace) % kWorkspaceAlignment != 0)
    return "workspace must be 256-byte aligned";
  for (std::string s : {check_strides("q", p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                        check_strides("k", p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                        check_strides("v", p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                        check_strides("o", p.o_batch_stride, p.o_row_stride, p.o_head_stride)})
    if (!s.empty()) return s;
  const DecodeKernel k = select_kernel(p, 1);  // no tile width changes the row blocks
  if (int64_t{p.heads_kv} * row_blocks(p, k) > kMaxGridYZ)
    return "heads_kv * row blocks exceeds the grid limit (65535)";
  return "";
}

namespace {
/// Whether k is the d128 16-row kernel (Sq x group <= 16: decode), which the split plan treats
/// apart in three places below.
bool is_d128_decode_kernel(const DecodeParams& p, const DecodeKernel& k) {
  return k.block_m == 16 && p.head_dim == 128;
}

/// Whether k's split count comes from sm_tier_splits (sm_90+, the default copy by TMA boxes,
/// tma_box_rows): the d128 16-row kernel on whole-tile boxes (dense K/V or power-of-two pages
/// >= 64 keys) and the d64 128-key kernels on dense K/V or power-of-two pages >= 64 keys.
bool planned_by_tiers(const DecodeParams& p, const DecodeKernel& k) {
  if (decode::copy_override() == 0 || device_major() < 9) return false;
  const int box_rows = decode::tma_box_rows(p, k.block_n);
  if (k.block_n == kWideBlockN) return box_rows >= kWidePage;
  return is_d128_decode_kernel(p, k) && box_rows == k.block_n;
}

/// Resident blocks per SM the split counts of the other kernels are planned for. At most two:
/// the H100 sweep (kernels/NOTES.md) found a third adds no bandwidth, while filling it takes 50%
/// more splits.
int planned_blocks_per_sm(const DecodeKernel& k) { return std::clamp(k.blocks_per_sm(), 1, 2); }

/// Whether p's unsplit grid of `base` blocks is left whole: splitting it to fill more of the GPU
/// costs partials, the combine and shorter pipelines, and on a grid that already covers most SMs
/// that cost more than it gained. Measured for the d64 128-key kernels and the d128 16-row
/// kernel (16 rows: Sq x group <= 16), on dense K/V or pages >= 64 keys (H200, unsplit vs the
/// wave-efficiency plan, kernels-decode-h200-2026-11-29-split-rule.md and -split-grid.md):
///  - grid >= 90% of the SMs: d64 B4 MHA Sk 512-64k 1.02-1.30x faster unsplit, B16 GQA 32:8
///    1.04-1.24x, B5 Sk4k 1.18x; d128 B20 GQA 32:8 (160 blocks) Sk4k-16k 1.08-1.12x, Sq4 1.21x;
///  - 70-90% with <= 4096 keys: d64 B3 MHA / B12 GQA Sk1k-4k 1.16-1.25x, d128 B3 MHA / B12 GQA
///    Sk4k 1.05-1.07x; at Sk16k the split wins there (3-8 splits, 1.03-1.13x), so the rule stops
///    at 4096 keys.
/// Pages of 16 keep the plan (the unsplit kernels lost up to 26% there: B4 d64 Sk16k), as do
/// fewer blocks (B2 d64: splits win from Sk2k) and the kernels nobody measured this way. On
/// sm_90's TMA path both kernels have their own plan since (sm_tier_splits); this rule stays for
/// them on cp.async (sm_80, packed varlen K/V, the copy knob).
bool grid_left_whole(const DecodeParams& p, const DecodeKernel& k, int64_t base, int sm_count) {
  const bool measured = k.block_n == kWideBlockN || is_d128_decode_kernel(p, k);
  const bool whole_tiles = p.block_table == nullptr || p.page_size >= kWidePage;
  if (!measured || !whole_tiles) return false;
  const int64_t sms = std::max(sm_count, 1);
  if (base * 10 >= sms * 9) return true;
  return base * 10 >= sms * 7 && p.seqlen_k <= kShortGridKeys;
}

/// The split count of one wave of resident blocks (the most splits whose grid fits the slots),
/// or 0 where the wave-efficiency plan applies. For the d128 16-row kernel on pages < 64 keys (two
/// blocks per SM planned) when that wave fills >= 70% of the slots: wave efficiency counts such
/// a wave as idle SMs, but it streams about as fast as a full one, while the plan's extra partial
/// wave is a slow tail. Pages of 16, H200, session 25
/// (kernels-decode-h200-2026-11-29-split-grid.md, K6 A/B): B12 GQA 32:8 / B3 MHA Sk4k 2 splits (192
/// blocks) 1.10-1.13x faster than the plan's 8, Sk16k even; B4 / B8 / B16 / B32 the same count as
/// the plan. Not below 70%: B20 (160 blocks unsplit) ran Sk16k 1.11x slower unsplit than on the
/// plan's 8 splits (K1).
int one_wave_splits(const DecodeParams& p, const DecodeKernel& k, int64_t base, int64_t slots,
                    int max_splits) {
  if (!is_d128_decode_kernel(p, k) || p.block_table == nullptr || p.page_size >= kWidePage ||
      base > slots)
    return 0;
  const int64_t splits = std::min<int64_t>(slots / base, max_splits);
  return base * splits * 10 >= slots * 7 ? int(splits) : 0;
}

/// A plan's efficiency per split count 1..kMaxSplits (index 0 unused; 0: a count not planned).
using SplitEfficiency = std::array<double, kMaxSplits + 1>;

/// The fewest of splits 1..max_splits whose efficiency is within 95% of the best (1 if none).
/// FlashAttention's num_splits_heuristic uses 85%; a memory-bound kernel loses that 15% as idle
/// SMs in its last wave.
int fewest_near_best(const SplitEfficiency& eff, int max_splits) {
  const double best = *std::max_element(eff.begin() + 1, eff.begin() + max_splits + 1);
  for (int s = 1; s <= max_splits; ++s)
    if (eff[s] > 0 && eff[s] >= 0.95 * best) return s;
  return 1;
}

/// Wave efficiency (blocks / slots over its ceiling) per split count (fewest_near_best).
int wave_efficiency_splits(int64_t base, int64_t slots, int max_splits) {
  SplitEfficiency eff{};  // on the stack: the plan runs per launch
  for (int s = 1; s <= max_splits; ++s) {
    const double waves = double(base * s) / double(slots);
    eff[s] = waves / std::ceil(waves);
  }
  return fewest_near_best(eff, max_splits);
}

/// Whether an unsplit grid of `base` blocks that fills the SMs ends in a wave of `slots`
/// resident blocks ragged enough to split (sm_tier_splits): a first and only wave 70-90% full,
/// or a later one below 90% full before the third. H200, session 28 (K1-K4): unsplit was the best
/// or within 1% at 61% of one wave (B20), at 91-97% full waves (B16, B30, B32, B64, B66, B90) and
/// from 3 waves (B100, B120); splits won 1.03-1.09x at 73-85% of one wave (B24-B28) and
/// 1.01-1.18x at 1.1-2.6 waves (B36-B84). Missed: B22 (67%; 3 splits are exactly two waves) and
/// B60 (1.82 waves at 91%), where splits ran 1.03-1.06x.
bool ragged_full_grid(int64_t base, int64_t slots) {
  const double waves = double(base) / double(slots);
  const double fill = waves / std::ceil(waves);
  return waves <= 1 ? fill >= 0.7 && fill < 0.9 : waves < 3 && fill < 0.9;
}

/// How the tier plan sees the kernel a split count runs: blocks per SM that fit, and blocks per
/// SM that keep enough K/V in flight for full speed (about 96 KB: one d128 16-row or 3-stage d64
/// block; two 2-stage d64 blocks of 64 KB).
struct TierKernel {
  int resident = 2;
  int full_speed = 1;
};

/// The tier of the kernel that runs p in `splits` splits (p planned by tiers): the d64 128-key
/// kernel takes 2 stages where each split is long (wide_stages), and with them more blocks per SM.
TierKernel tier_kernel(const DecodeParams& p, const DecodeKernel& k, int splits) {
  if (k.block_n == kWideBlockN && splits > 1 && p.seqlen_k / splits >= kLongSplitKeys)
    return {std::clamp(wide_kernel<__half>(2).blocks_per_sm(), 1, 3), 2};
  const DecodeKernel unsplit = k.block_n == kWideBlockN ? wide_kernel<__half>(3) : k;
  return {planned_blocks_per_sm(unsplit), 1};
}

/// Efficiency of a grid of g blocks on sms SMs: up to the blocks that run at full speed, g over
/// them; beyond, g over its waves of resident blocks.
double tier_efficiency(int64_t g, int64_t sms, TierKernel t) {
  const int64_t full = sms * t.full_speed;
  if (g <= full) return double(g) / double(full);
  const int64_t slots = sms * t.resident;
  return double(g) / double(slots * ((g + slots - 1) / slots));
}

/// The split count of the kernels planned_by_tiers. Up to one block per SM a grid streams at
/// nearly full speed (96 KB in flight per block; 2-stage d64 blocks need two per SM); beyond,
/// blocks run in waves of what fits per SM (tier_efficiency), and the plan takes the fewest
/// splits within 95% of the best. Blocks of a grid past the SM count keep >= 16 key tiles (32
/// where the unsplit grid already fills the SMs; more with > 8 rows per block) to pay for their
/// prologue, partial and merge; from 80% of the SMs only a ragged grid splits (B14 Sk8k, 112
/// blocks: 1.08x faster unsplit than on 7 splits). H200, session 28
/// (kernels-decode-h200-2026-11-30-split-tiers.md): d128 0.992-1.18x the earlier plan on 132
/// rows, geometric mean 1.026x -- that plan counted waves of one block per SM (session 13) where
/// two ran; GQA 32:8 Sq4 B24 Sk8k ran 0.93x on 4 splits of 2048 keys (K7), hence the rows. d64
/// (K9, 36 held-out rows): 0.956-1.23x the earlier plan, geometric mean 1.042x (worst: B13 MHA
/// Sk16k on pages of 64, whose unsplit grid runs unusually well); without the depth (tier_kernel)
/// two splits lost 4-14% on 1.1-wave grids of 396 (K6).
int sm_tier_splits(const DecodeParams& p, const DecodeKernel& k, int64_t base, int sm_count,
                   int max_splits) {
  const int64_t sms = std::max(sm_count, 1);
  const bool fills_sms = base * 10 >= sms * 8;  // one block on >= 80% of the SMs unsplit
  const TierKernel unsplit = tier_kernel(p, k, 1);
  if (fills_sms && (base <= sms || !ragged_full_grid(base, sms * unsplit.resident))) return 1;
  const int64_t tiles = key_tiles(p, k);
  // More rows per block (speculative Sq > 1) make each split's partial and merge larger.
  const int64_t rows = int64_t{p.heads_q / p.heads_kv} * std::max(p.seqlen_q, 1);
  const int64_t min_tiles =
      (base > sms ? kMinTilesPastFullGrid : kMinTilesPastSms) * std::max<int64_t>(rows, 8) / 8;
  SplitEfficiency eff{};
  for (int s = 1; s <= max_splits; ++s) {
    const int64_t g = base * s;
    if (g > sms && s > 1 && tiles / s < min_tiles) continue;
    eff[s] = tier_efficiency(g, sms, tier_kernel(p, k, s));
  }
  return fewest_near_best(eff, max_splits);
}

/// decode_num_splits for kernel k.
int plan_splits(const DecodeParams& p, const DecodeKernel& k, int sm_count) {
  const int64_t base = int64_t{std::max(p.batch, 1)} * p.heads_kv * row_blocks(p, k);
  const int max_splits = std::clamp(key_tiles(p, k) / kMinTilesPerSplit, 1, kMaxSplits);
  if (planned_by_tiers(p, k)) return sm_tier_splits(p, k, base, sm_count, max_splits);
  if (grid_left_whole(p, k, base, sm_count)) return 1;
  const int64_t slots = int64_t{std::max(sm_count, 1)} * planned_blocks_per_sm(k);
  const int planned = wave_efficiency_splits(base, slots, max_splits);
  // One wave instead, where it applies and the plan's grid spills into a second, partial wave
  // (a plan within one wave already fills it: B1 Sk128k 32 splits ran 1% faster than one wave's
  // 33).
  const int one_wave = one_wave_splits(p, k, base, slots, max_splits);
  return one_wave > 0 && base * planned > slots ? one_wave : planned;
}

/// 0: p runs on 64-key tiles; 2 or 3: on the d64 16-row kernel with 128-key tiles and that many
/// stages. Unsplit (one block per sequence and KV head): 128 keys and 3 stages, whatever the
/// pages (two blocks per SM, as the split plan assumes; the 64-key kernel fits three, and its
/// waves then end ragged). Split: pages < kWidePage keep 64-key tiles; otherwise 128 keys, with
/// 2 stages when each split is long (>= kLongSplitKeys), else 3. H200, session 23 (K2, K4, K5;
/// 3 interleaved rounds, % of 4.8 TB/s, ratios to the 64-key kernel):
///  - unsplit batches of 512 blocks (B16 MHA, B64 GQA 32:8, Sk 4k-64k): 76-81% -> 86-95% dense
///    and pages of 64, 71-76% -> 85-94% on pages of 16 (2 stages: 82-89%, 76-81% on pages of
///    16); B64 Sk4k-16k MHA 0.99-1.00x; B256 Sk1k pages of 16 0.99x;
///  - split: B1 Sk128k 1.006-1.033x with 2 stages (3: 0.99-1.02x); B4 Sk16k-64k 1.02-1.05x
///    (3: 0.99-1.02x); pages of 16 0.93-0.96x with either (so 64 keys there).
/// wide_tiles_override: 0 never, 1 this choice of stages wherever compiled (split small pages
/// too), 2 / 3 that depth wherever compiled.
int wide_stages(const DecodeParams& p, int rows, int sm_count) {
  if (p.head_dim != 64 || rows > 16) return 0;
  const int mode = decode::wide_tiles_override();
  if (mode == 0 || mode == 2 || mode == 3) return mode;
  // Both depths plan the same splits (same tiles; both fit >= 2 blocks per SM).
  const int splits =
      p.num_splits > 0 ? p.num_splits : plan_splits(p, wide_kernel<__half>(3), sm_count);
  if (splits == 1) return 3;
  if (mode < 0 && p.block_table != nullptr && p.page_size < kWidePage) return 0;
  return p.seqlen_k / splits >= kLongSplitKeys ? 2 : 3;
}

DecodeKernel select_kernel(const DecodeParams& p, int sm_count) {
  const int rows = (p.heads_q / p.heads_kv) * std::max(p.seqlen_q, 1);
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (const int stages = wide_stages(p, rows, sm_count); stages > 0)
    return bf16 ? wide_kernel<__nv_bfloat16>(stages) : wide_kernel<__half>(stages);
  return bf16 ? kernel_for<__nv_bfloat16>(p.head_dim, rows) : kernel_for<__half>(p.head_dim, rows);
}
}  // namespace

int decode_num_splits(const DecodeParams& p, int sm_count) {
  if (p.heads_kv < 1 || p.heads_q < p.heads_kv || p.heads_q % p.heads_kv != 0) return 1;
  const DecodeKernel k = select_kernel(p, sm_count);
  if (k.launch == nullptr) return 1;
  return plan_splits(p, k, sm_count);
}

std::vector<int> decode_split_candidates(const DecodeParams& p, int sm_count) {
  std::vector<int> out{1};
  if (p.heads_kv < 1 || p.heads_q < p.heads_kv || p.heads_q % p.heads_kv != 0) return out;
  const DecodeKernel k = select_kernel(p, sm_count);
  if (k.launch == nullptr) return out;
  const int tiles = key_tiles(p, k);
  const int limit = std::min(tiles, kMaxSplits);
  const int64_t base = int64_t{std::max(p.batch, 1)} * p.heads_kv * row_blocks(p, k);
  const int64_t slots = int64_t{std::max(sm_count, 1)} * std::clamp(k.blocks_per_sm(), 1, 2);
  out.push_back(decode_num_splits(p, sm_count));
  for (int waves : {1, 2, 4}) out.push_back(static_cast<int>((waves * slots + base - 1) / base));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(std::remove_if(out.begin(), out.end(), [&](int s) { return s < 1 || s > limit; }),
            out.end());
  if (out.empty() || out.front() != 1) out.insert(out.begin(), 1);
  return out;
}

size_t decode_workspace_bytes(const DecodeParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = size_t(num_splits) * size_t(std::max(total_q_rows(p), 0)) * p.heads_q;
  return align256(rows * p.head_dim * 4) + align256(rows * 4);
}

cudaError_t run_decode(const DecodeParams& p, cudaStream_t stream) {
  if (!decode_supported(p).empty()) return cudaErrorInvalidValue;
  const int total_q = total_q_rows(p);
  if (p.batch == 0 || total_q == 0) return cudaSuccess;
  // The SM count only plans splits; a caller that names its split count (the server's tuned
  // ones) does not pay the device queries on every launch.
  const int sm_count = p.num_splits > 0 ? 1 : sm_count_of_current_device();
  const DecodeKernel k = select_kernel(p, sm_count);
  decode::last_block_n() = k.block_n;
  decode::last_stages() = k.stages;
  DecodeLaunch L;
  L.p = p;
  L.group = p.heads_q / p.heads_kv;
  L.row_blocks = row_blocks(p, k);
  L.total_q = total_q;
  L.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  if (p.block_table != nullptr && (p.page_size & (p.page_size - 1)) == 0) {
    L.page_shift = 0;
    while ((1 << L.page_shift) < p.page_size) ++L.page_shift;
  }
  // A power-of-two page of >= block_n keys holds whole tiles (tiles start at multiples of
  // block_n, a power of two): one block-table read per tile. Smaller pages: one per row / box.
  L.tile_in_page = L.page_shift >= 0 && (1 << L.page_shift) >= k.block_n;
  const int copy = decode::copy_override() >= 0 ? decode::copy_override() : default_copy_sm90(p);
  const bool sm90 = device_major() >= 9;  // one query for the TMA and PDL choices below
  if (decode::l2_prefetch_override() >= 0) L.l2_prefetch = decode::l2_prefetch_override();
  if (copy == 2 && sm90) L.tma = setup_tma(p, k, &L);
  decode::last_copy() = L.tma ? 2 : 0;
  L.deep_issue = decode::deep_issue_override() == 1;  // off by default: no gain on H100 (run 6)
  L.pdl = (decode::pdl_override() < 0 ? kPdlByDefault : decode::pdl_override() == 1) && sm90;
  const int tiles = key_tiles(p, k);
  const int splits = p.num_splits > 0 ? p.num_splits : plan_splits(p, k, sm_count);
  L.num_splits = std::max(1, std::min(splits, tiles));
  decode::last_merge() = 0;
  if (L.num_splits == 1) return k.launch(L, stream);

  const size_t bytes = decode_workspace_bytes(p, L.num_splits);
  void* workspace = p.workspace;
  if (workspace != nullptr && p.workspace_bytes < bytes) return cudaErrorInvalidValue;
  if (workspace == nullptr) {
    if (cudaError_t err = cudaMallocAsync(&workspace, bytes, stream); err != cudaSuccess) return err;
  }
  const size_t rows = size_t(L.num_splits) * total_q * p.heads_q;
  L.o_partial = static_cast<float*>(workspace);
  L.lse_partial = reinterpret_cast<float*>(static_cast<char*>(workspace) + align256(rows * p.head_dim * 4));
  const decode::MergeSlot merge =
      decode::plan_in_kernel_merge(p, k, L.num_splits, L.row_blocks, stream);
  L.merge_counters = merge.counters;
  decode::last_merge() = L.merge_counters != nullptr ? 2 : 1;
  cudaError_t err = k.launch(L, stream);
  decode::finish_in_kernel_merge(merge, stream, err == cudaSuccess);
  if (err == cudaSuccess && L.merge_counters == nullptr)
    err = decode::launch_decode_combine(L, stream);
  if (p.workspace == nullptr) {
    const cudaError_t free_err = cudaFreeAsync(workspace, stream);
    if (err == cudaSuccess) err = free_err;
  }
  return err;
}

}  // namespace flashserve::kernels::cuda
