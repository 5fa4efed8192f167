// Compile-time shape of one decode kernel and the runtime arguments every decode launch shares.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only: nothing links libcuda)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>

#include "decode_tensor_map.h"  // tma_slice_cols
#include "flashserve/kernels/decode_attention.h"

namespace flashserve::kernels::cuda::decode {

/// A block has 4 warps over a tile of kBlockM packed query rows x kBlockN keys. Packed row r of
/// a KV head is (query position r / group, query head r % group), so the rows of one block share
/// that KV head and K/V are read once per block. kWarpsM warps are stacked over rows (16 each),
/// kWarpsN = 4 / kWarpsM side by side over keys (kWarpN keys each); the kWarpsN partial softmax
/// states are merged once, after the last tile. Decode (<= 16 rows) uses kWarpsM = 1: four
/// warps split each 64-key tile (128-key tile: the d64 wide kernel); speculative decode with
/// many rows uses kWarpsM = 2 or 4. kBlockN_ (keys per tile) and kStages_: 0 for the defaults
/// (below).
template <typename Element_, int kHeadDim_, int kWarpsM_, int kBlockN_ = 0, int kStages_ = 0>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kWarpsM = kWarpsM_;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kBlockM = 16 * kWarpsM;
  // 64 keys per tile by default; 32 when four warps are stacked over 64 rows, so that the 64-row
  // blocks still fit two per SM at d128 with four stages. 128 (kBlockN_, instantiated only for the
  // d64 16-row kernel, FLASHSERVE_DECODE_WIDE_INSTANCES): each warp reads 32 keys per tile, as
  // cuDNN's d64 decode kernel tiles 16 x 128 keys (kernels/NOTES.md, session 22, K4-K5).
  static constexpr int kBlockN = kBlockN_ > 0 ? kBlockN_ : (kWarpsM == 4 ? 32 : 64);
  static constexpr int kWarpN = kBlockN / kWarpsN;
  static constexpr int kNTiles = kWarpN / 8;     // n8 tiles of S per warp
  static constexpr int kDTiles = kHeadDim / 8;   // n8 tiles of O per warp
  static constexpr int kChunks = kHeadDim / 8;   // 16-byte chunks per row
  // Shared rows are padded by 16 bytes: consecutive rows then start 4 banks apart (mod 32) for
  // every head dim here, so ldmatrix's 8 row addresses hit distinct banks without a swizzle
  // (the family's XOR swizzle needs 8 chunks per row, which d32 / d96 do not have).
  static constexpr int kRowElems = kHeadDim + 8;
  // Deep enough that each SM keeps >= 64 KB of K/V loads in flight (memory speed needs ~25 KB
  // per SM on an H100), shallow enough for two blocks per SM up to d128. The d64 128-key kernels
  // come with 2 and 3 stages (kStages_; decode_dispatch.cu's select_kernel says which runs where).
  static constexpr int kStages = kStages_ > 0                        ? kStages_
                                 : (kHeadDim <= 64 || kBlockN == 32) ? 4
                                                                     : (kHeadDim <= 128 ? 3 : 2);
  static constexpr int kTileElems = kBlockN * kRowElems;
  static constexpr int kQElems = kBlockM * kRowElems;
  static constexpr size_t kPipelineBytes = size_t(kQElems + 2 * kStages * kTileElems) * 2;
  // The TMA pipeline (decode_tma.h, sm_90) stores K/V tiles unpadded, as [kTmaSlices][kBlockN]
  // rows of kSliceBytes, swizzled by that width; its stages start 1024-byte aligned (the largest
  // swizzle atom), hence the slack. Never larger than the padded layout (checked below).
  static constexpr int kSliceCols = tma_slice_cols(kHeadDim);
  static constexpr int kSliceBytes = kSliceCols * 2;
  static constexpr int kTmaSlices = kHeadDim / kSliceCols;
  // Whether the kernel carries the TMA path at all. 32-column slices only in the 16-row kernels:
  // compiled into the 32/64-row d96 kernels, the TMA branch slowed their cp.async path by 2-6%
  // (register allocation of the whole kernel; H200, session 25, K4), and TMA itself lost there.
  static constexpr bool kHasTma = kSliceCols == 64 || kWarpsM == 1;
  static constexpr uint32_t kTmaTileBytes = uint32_t(kBlockN) * kHeadDim * 2;
  static constexpr size_t kTmaPipelineBytes =
      (size_t(kQElems) * 2 + 1023) / 1024 * 1024 + 2 * kStages * size_t(kTmaTileBytes) + 1024;
  // Epilogue (reuses the pipeline's memory): kWarpsN slices of O rows in fp32, the per-warp row
  // max and sum, and the block's LSE per row.
  static constexpr size_t kEpilogueBytes =
      size_t(kWarpsN * kBlockM * kHeadDim + 2 * kWarpsN * kBlockM + kBlockM) * 4;
  static constexpr size_t kSmemBytes =
      kPipelineBytes > kEpilogueBytes ? kPipelineBytes : kEpilogueBytes;

  static_assert(kTmaPipelineBytes <= kSmemBytes, "the TMA layout must fit the padded one");
  static_assert(kHeadDim % 32 == 0, "head_dim must be a multiple of 32 (TMA slices)");
  static_assert(kWarpN % 16 == 0, "each warp needs whole k16 steps of keys");
  static_assert((kBlockN * kChunks) % kThreads == 0, "tile loads must divide over the threads");
  // Power of two: a power-of-two page >= kBlockN then holds whole tiles (DecodeLaunch::
  // tile_in_page); <= 256: a TMA box's row count (decode_tensor_map.cc).
  static_assert(kBlockN == 32 || kBlockN == 64 || kBlockN == 128,
                "tile widths: 32, 64 or 128 keys");
  static_assert(kStages >= 2, "the pipeline waits for all but kStages - 2 younger tiles");
};

/// Runtime arguments of the split and combine kernels (passed by value, __grid_constant__).
struct DecodeLaunch {
  DecodeParams p;
  int num_splits = 1;
  int group = 1;        // heads_q / heads_kv
  int row_blocks = 1;   // blocks over the packed rows of one (sequence, KV head)
  int total_q = 0;      // query rows over the batch (batch * seqlen_q when fixed)
  float scale_log2 = 0.f;
  int l2_prefetch = 128;  // L2 prefetch hint of the K/V cp.async: 0, 128 or 256 bytes (256: no gain at d128, -6 to -16% at d64, run 6)
  // sm_90: K/V tiles by TMA boxes of tma_rows keys x one slice (tma_slice_cols) on mbarriers
  // (decode_tma.h); the maps view K and V as [pages][page rows][slices][heads_kv][slice columns]
  // (decode_tensor_map.h).
  bool tma = false;
  int tma_rows = 0;
  bool tma_wide = false;  // one box spans all slices (tma_rows == kBlockN only)
  CUtensorMap tma_k{}, tma_v{};
  int page_shift = -1;    // log2(page_size) when a power of two (shift/mask, no division)
  // page_size a power of two >= the kernel's kBlockN: a key tile never crosses a page, so one
  // block-table read serves the whole tile (lookup_rows, decode_tile_io.h)
  bool tile_in_page = false;
  bool pdl = false;       // sm_90: programmatic dependent launch (decode_launch_template.h)
  bool deep_issue = false;  // issue tile t + stages - 1 before waiting for tile t (decode_kernel.h)
  float* o_partial = nullptr;    // [num_splits, total_q, heads_q, head_dim] fp32
  float* lse_partial = nullptr;  // [num_splits, total_q, heads_q] fp32 (natural log)
  // Non-null: the last block of each (sequence, KV head, row block) to finish merges its splits'
  // partials in place (decode_merge.h) and no combine kernel runs. One counter per group, zero
  // before the launch and zero again after it (a slot of decode_merge_plan.cu).
  unsigned* merge_counters = nullptr;
};

/// A compiled split kernel: queue it, and how many of its blocks fit on one SM.
struct DecodeKernel {
  cudaError_t (*launch)(const DecodeLaunch&, cudaStream_t) = nullptr;
  int (*blocks_per_sm)() = nullptr;
  int block_m = 16;
  int block_n = 64;  // keys per tile (DecodeTraits::kBlockN): tile counts, TMA boxes, tile_in_page
  int stages = 4;    // DecodeTraits::kStages (tests and benchmarks: which kernel ran)
  bool has_tma = true;  // DecodeTraits::kHasTma: the kernel can load K/V by TMA boxes
  size_t smem_bytes = 0;  // DecodeTraits::kSmemBytes: what the in-kernel merge may stage
};

/// Defined in decode_launch_template.h, instantiated in the decode_d*.cu files (kBlockN and
/// kStages 0: the defaults, see DecodeTraits).
template <typename Element, int kHeadDim, int kWarpsM, int kBlockN = 0, int kStages = 0>
DecodeKernel decode_kernel();

/// The L2 prefetch size run_decode passes to the kernels (a benchmarking knob; see
/// flashserve_decode_set_l2_prefetch in decode_capi.cc). -1: the default.
int& l2_prefetch_override();

/// Which K/V copy run_decode asks for (a benchmarking knob, flashserve_decode_set_copy):
/// -1 default, 0 cp.async, 2 TMA boxes (sm_90 and later). 1 selected one cp.async.bulk per K/V
/// row until session 8 (slower than TMA everywhere, run 7): now the same as 0.
int& copy_override();

/// Whether TMA boxes span all 64-column slices of a row when a run is a whole tile (a
/// benchmarking knob, flashserve_decode_set_tma_wide): -1 default, 0 no, 1 yes.
int& tma_wide_override();

/// Whether the d64 16-row problems run the kernel on 128-key tiles (a benchmarking knob,
/// flashserve_decode_set_wide_tiles): -1 default (dense K/V and pages >= 64 keys, stages by the
/// split plan), 0 never (64-key tiles), 1 always where compiled (head_dim 64, <= 16 packed rows;
/// any page size; stages by the split plan), 2 / 3 always where compiled, with that many stages.
int& wide_tiles_override();

/// The K/V copy the calling thread's last run_decode used (0 cp.async, 2 TMA; -1 none yet), so
/// that tests can tell a path that ran from one that fell back. Per thread (the server's tuner
/// and Sequences store call run_decode from different threads), like every last_*() below.
int& last_copy();

/// Keys per tile of the kernel the thread's last run_decode used (32, 64 or 128; 0 none yet), so
/// that tests can tell which tile width ran.
int& last_block_n();
/// Pipeline stages of that kernel (DecodeTraits::kStages; 0 none yet).
int& last_stages();

/// Whether run_decode launches with programmatic dependent launch (a benchmarking knob,
/// flashserve_decode_set_pdl): -1 default, 0 off, 1 on (used only on sm_90 and later).
int& pdl_override();

/// Whether split launches merge their partials in the split kernel's last block per group
/// (decode_merge.h) instead of a combine kernel (a benchmarking knob,
/// flashserve_decode_set_fused_merge): -1 default, 0 combine kernel, 1 in-kernel up to the size
/// limit (decode_merge_plan.cu), 2 in-kernel wherever shared memory holds the partials.
int& fused_merge_override();

/// How the thread's last run_decode merged its splits: 0 one split (nothing to merge), 1 the
/// combine kernel, 2 in the split kernel (its counter slot: last_counter_slot, counter_slots.h).
int& last_merge();

/// Whether run_decode asks for the deep issue order (a benchmarking knob,
/// flashserve_decode_set_deep_issue): -1 default, 0 off, 1 on.
int& deep_issue_override();

/// Programmatic dependent launch, device side (sm_90+; a no-op elsewhere and when the grid was
/// launched without the attribute): wait until the grid queued before this one has finished and
/// its writes are visible, then allow the grid queued after this one to launch, so that its
/// launch and block scheduling overlap this grid's work instead of following it.
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/// Max and sum of x over the 32 lanes of a warp (every lane gets the result; all must call):
/// the combine kernel's and the in-kernel merge's LSE reductions.
__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

/// Queues kernel(L) with the programmatic-serialization attribute when L.pdl is set.
template <typename Kernel>
cudaError_t launch_decode_grid(Kernel kernel, dim3 grid, int threads, size_t smem,
                               const DecodeLaunch& L, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = L.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, L);
}

/// Combine kernel for the output dtype of launch.p (decode_combine.cu).
cudaError_t launch_decode_combine(const DecodeLaunch& launch, cudaStream_t stream);

#define FLASHSERVE_DECODE_INSTANCES(EXTERN, HEAD_DIM)                                  \
  EXTERN template DecodeKernel decode_kernel<__half, HEAD_DIM, 1>();                   \
  EXTERN template DecodeKernel decode_kernel<__half, HEAD_DIM, 2>();                   \
  EXTERN template DecodeKernel decode_kernel<__half, HEAD_DIM, 4>();                   \
  EXTERN template DecodeKernel decode_kernel<__nv_bfloat16, HEAD_DIM, 1>();            \
  EXTERN template DecodeKernel decode_kernel<__nv_bfloat16, HEAD_DIM, 2>();            \
  EXTERN template DecodeKernel decode_kernel<__nv_bfloat16, HEAD_DIM, 4>();

/// The d64 16-row kernels on 128-key tiles with 2 and 3 stages, chosen by select_kernel in
/// decode_dispatch.cu for dense K/V and pages >= 64 keys; compiled for head_dim 64 only.
#define FLASHSERVE_DECODE_WIDE_INSTANCES(EXTERN)                              \
  EXTERN template DecodeKernel decode_kernel<__half, 64, 1, 128, 2>();        \
  EXTERN template DecodeKernel decode_kernel<__nv_bfloat16, 64, 1, 128, 2>(); \
  EXTERN template DecodeKernel decode_kernel<__half, 64, 1, 128, 3>();        \
  EXTERN template DecodeKernel decode_kernel<__nv_bfloat16, 64, 1, 128, 3>();

}  // namespace flashserve::kernels::cuda::decode
