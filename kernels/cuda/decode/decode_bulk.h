// Hopper (sm_90) K/V loads for the decode kernel: one cp.async.bulk per K or V row (a head's
// 2 * head_dim contiguous bytes) completing on a per-stage mbarrier, instead of 16-byte cp.async
// per thread. The copy engine then moves the tile; threads only issue one copy each.
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

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

/// Pipeline of the split kernel on bulk copies. Thread i < 2 * kBlockN owns row i % kBlockN of
/// K (i < kBlockN) or V; its page is looked up one tile ahead, as in the cp.async pipeline.
template <typename T>
struct BulkPipe {
  static constexpr bool kSwizzled = false;
  static __device__ __forceinline__ uint32_t kv_base(uint32_t q_end) { return q_end; }
  static constexpr uint32_t kTileBytes = T::kTileElems * 2;
  static constexpr uint32_t kRowBytes = T::kHeadDim * 2;
  const DecodeLaunch& L;
  const BlockWork& w;
  uint32_t bars;  // kStages mbarriers, 8 bytes apart
  int key0 = 0, page = 0, in_page = 0;

  __device__ __forceinline__ BulkPipe(const DecodeLaunch& l, const BlockWork& wk, uint64_t* b)
      : L(l), w(wk), bars(ptx::smem_addr(b)) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < T::kStages; ++s) mbar_init(bars + 8 * s, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }

  __device__ __forceinline__ void lookup(int k0) {
    key0 = k0;
    const int key = k0 + int(threadIdx.x) % T::kBlockN;
    if (L.p.block_table == nullptr) {
      page = 0;
      in_page = key;
    } else {
      const int kk = key < w.sk ? key : 0;
      const int slot = L.page_shift >= 0 ? kk >> L.page_shift : kk / L.p.page_size;
      in_page = L.page_shift >= 0 ? kk & (L.p.page_size - 1) : kk % L.p.page_size;
      page = __ldg(L.p.block_table + w.b * L.p.block_table_stride + slot);
    }
  }

  /// Queues the looked-up tile into stage `stage` (K at k_tile, V one tile further).
  __device__ __forceinline__ void issue(int stage, uint32_t k_tile) {
    using Element = typename T::Element;
    const DecodeParams& p = L.p;
    const int valid_rows = min(T::kBlockN, w.sk - key0);
    const uint32_t bar = bars + 8 * stage;
    if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, uint32_t(valid_rows) * 2 * kRowBytes);
    if (threadIdx.x >= 2 * T::kBlockN) return;
    const int r = int(threadIdx.x) % T::kBlockN;
    const bool is_v = int(threadIdx.x) >= T::kBlockN;
    const uint32_t dst = k_tile + (is_v ? kTileBytes : 0) + r * T::kRowElems * 2;
    if (r < valid_rows) {
      const bool paged = p.block_table != nullptr;
      const int64_t row = is_v ? (paged ? page * p.v_batch_stride : 0) + in_page * p.v_row_stride
                               : (paged ? page * p.k_batch_stride : 0) + in_page * p.k_row_stride;
      const Element* src = static_cast<const Element*>(is_v ? p.v : p.k) + (is_v ? w.v_off : w.k_off) + row;
      // Orders this thread's earlier generic writes (zero rows) before the copy engine's.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      bulk_copy(dst, src, kRowBytes, bar);
    } else {  // past the sequence's end: zeros (P is 0 there; 0 * garbage could be NaN)
      for (uint32_t b = 0; b < kRowBytes; b += 16)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst + b), "r"(0) : "memory");
    }
  }

  /// Closes the cp.async group of Q (the only cp.async here; later groups are empty), so that
  /// wait()'s cp.async.wait_group covers it.
  __device__ __forceinline__ void commit() { ptx::cp_async_commit(); }

  /// Waits for the tile of step t (stage t % kStages, its (t / kStages)-th use) and for Q.
  __device__ __forceinline__ void wait(int t, bool /*deep: one mbarrier per stage either way*/,
                                       uint32_t /*k_tile*/) {
    ptx::cp_async_wait<0>();  // Q (cp.async); nothing else uses cp.async here
    mbar_wait(bars + 8 * (t % T::kStages), (t / T::kStages) & 1);
  }
};

}  // namespace flashserve::kernels::cuda::decode
