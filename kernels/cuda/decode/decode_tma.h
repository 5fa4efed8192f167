// Hopper (sm_90) K/V loads for the decode kernel through TMA: per key tile, boxes of tma_rows
// keys x one slice of columns (64; 32 at d32 / d96: tma_slice_cols), one per page run, slice and
// operand, issued by lanes of warp 0 and completing on the stage's mbarrier. The cp.async path
// spends ~2048 16-byte copies, each with its own address and page arithmetic, per 32 KB tile;
// Nsight Compute found that loop issue-bound (kernels/NOTES.md, run 6). Tiles land unpadded and
// swizzled by the slice's row width (128 or 64 bytes): decode_kernel.h reads them with swizzled
// ldmatrix addresses (Pipe::kSwizzled).
#pragma once

#include <cstdint>

#include "decode_tile_io.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

/// Arrives once and raises the barrier's expected transaction bytes by tx.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(tx)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

/// 5-d tiled TMA load global -> shared completing on bar; coordinates innermost first
/// (column in the slice, row in page, slice, KV head, page). Out of bounds: zeros.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

/// Pipeline of the split kernel on TMA boxes. A tile of kBlockN keys is kBlockN / tma_rows runs
/// (a run: keys of one page, or the whole tile when pages hold whole tiles or K/V is dense);
/// lane i < 2 * kTmaSlices * runs of warp 0 owns one (run, operand, slice) box; with L.tma_wide
/// (runs = 1) lane 0 / 1 owns a box of all slices of K / V.
/// Stage layout: K then V, each [kTmaSlices][kBlockN][kSliceCols elements].
template <typename T>
struct TmaPipe {
  static constexpr bool kSwizzled = true;
  static constexpr uint32_t kTileBytes = T::kTmaTileBytes;
  static constexpr uint32_t kSliceBytes = T::kSliceBytes;
  static constexpr uint32_t kSliceTileBytes = T::kBlockN * kSliceBytes;  // one slice of a tile
  const DecodeLaunch& L;
  const BlockWork& w;
  uint32_t bars;  // kStages mbarriers, 8 bytes apart
  int key0 = 0;
  int page = 0, row = 0;  // this lane's box: page (dense: the sequence) and its first row there
  int run = 0, slice = 0;
  bool is_v = false, copier = false;

  __device__ __forceinline__ TmaPipe(const DecodeLaunch& l, const BlockWork& wk, uint64_t* b)
      : L(l), w(wk), bars(ptx::smem_addr(b)) {
    const int boxes = L.tma_wide ? 1 : T::kTmaSlices;  // boxes per run and operand
    copier = int(threadIdx.x) < 2 * boxes * (T::kBlockN / L.tma_rows);
    run = int(threadIdx.x) / (2 * boxes);
    is_v = int(threadIdx.x) % (2 * boxes) >= boxes;
    slice = int(threadIdx.x) % boxes;
    if (threadIdx.x == 0) {
      for (int s = 0; s < T::kStages; ++s) mbar_init(bars + 8 * s, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&L.tma_k))
                   : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&L.tma_v))
                   : "memory");
    }
    __syncthreads();
  }

  /// First stage: the 1024-byte swizzle atom after Q (the 64-byte swizzle's is 512).
  static __device__ __forceinline__ uint32_t kv_base(uint32_t q_end) {
    return (q_end + 1023) & ~1023u;
  }

  __device__ __forceinline__ void lookup(int k0) {
    key0 = k0;
    if (!copier) return;
    const int key = k0 + run * L.tma_rows;
    if (L.p.block_table == nullptr) {
      page = w.b;
      row = key;
    } else {  // power-of-two pages (dispatch); a run past the end is not issued: any page will do
      const int kk = key < w.sk ? key : 0;
      page = __ldg(L.p.block_table + w.b * L.p.block_table_stride + (kk >> L.page_shift));
      row = kk & (L.p.page_size - 1);
    }
  }

  /// Queues the looked-up tile into the stage at k_tile: lane 0 arms the barrier with the bytes
  /// of the runs that hold keys, then each copier lane of such a run issues its box.
  __device__ __forceinline__ void issue(int stage, uint32_t k_tile) {
    if (threadIdx.x >= 32) return;
    const int rows = L.tma_rows;
    const int runs = min(T::kBlockN / rows, (w.sk - key0 + rows - 1) / rows);
    const uint32_t bar = bars + 8 * stage;
    const uint32_t bytes = uint32_t(runs * 2 * T::kTmaSlices * rows) * kSliceBytes;
    if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, bytes);
    __syncwarp();
    if (copier && run < runs) {
      const uint32_t dst =
          k_tile + (is_v ? kTileBytes : 0) + slice * kSliceTileBytes + run * rows * kSliceBytes;
      tma_load_5d(dst, is_v ? &L.tma_v : &L.tma_k, bar, 0, row, slice, w.hkv, page);
    }
  }

  /// Closes the cp.async group of Q (the only cp.async here), so wait()'s wait_group covers it.
  __device__ __forceinline__ void commit() { ptx::cp_async_commit(); }

  /// Waits for the tile of step t (stage t % kStages, its (t / kStages)-th use) and for Q, then
  /// zeroes the V rows past the sequence's end: they hold the rest of the last page (or nothing
  /// was loaded there), and P = 0 times a NaN there would still be NaN. K rows there are masked.
  __device__ __forceinline__ void wait(int t, bool /*deep*/, uint32_t k_tile) {
    ptx::cp_async_wait<0>();
    mbar_wait(bars + 8 * (t % T::kStages), (t / T::kStages) & 1);
    const int valid = w.sk - (w.tile_begin + t) * T::kBlockN;
    if (valid >= T::kBlockN) return;
    constexpr int kLineChunks = kSliceBytes / 16;  // 16-byte chunks per row of a slice
    const int chunks = (T::kBlockN - valid) * T::kTmaSlices * kLineChunks;
    for (int i = threadIdx.x; i < chunks; i += T::kThreads) {
      const int line = i / kLineChunks, r = valid + line / T::kTmaSlices, h = line % T::kTmaSlices;
      const uint32_t at =
          k_tile + kTileBytes + h * kSliceTileBytes + r * kSliceBytes + (i % kLineChunks) * 16;
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(0) : "memory");
    }
    // Later TMA writes to these bytes (none in this block today) must come after the zeros.
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
};

}  // namespace flashserve::kernels::cuda::decode
