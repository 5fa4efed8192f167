// Host side of the split kernel's in-place merge (decode_merge.h is the device side): whether a
// launch merges in the kernel, and the slot of group counters it counts on. Defined in
// decode_merge_plan.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "../counter_slots.h"
#include "decode_traits.h"

namespace flashserve::kernels::cuda::decode {

/// The counters of an in-kernel merge: a slot of zeroed group counters, or counters null when
/// the combine kernel runs instead.
struct MergeSlot {
  unsigned* counters = nullptr;
  CounterSlot lent;  // the slot's loan (counter_slots.h)
};

/// Bytes before the staged partials in merge_partials' shared memory (decode_merge.h): the
/// partial row index of each of the block's block_m rows (int64), then the splits x rows
/// weights (floats, padded to 16 bytes). The partials follow: splits x rows x head_dim floats.
__host__ __device__ constexpr size_t merge_header_bytes(int block_m, int splits, int rows) {
  return size_t(block_m) * 8 + (size_t(splits) * rows * 4 + 15) / 16 * 16;
}

/// A counter slot for an in-kernel merge of p's num_splits splits launched on stream, or an
/// empty MergeSlot: the knob (fused_merge_override) says no, the launch has more groups than a
/// slot, a block's partial rows over all splits exceed 8 KB (no gain measured there; knob 2
/// lifts that limit) or kernel k's
/// shared memory, the stream is capturing, or no slot is free (decode_merge_plan.cu says when
/// one is: counter_slots.h). Every non-empty slot must be handed to finish_in_kernel_merge after
/// the launch.
MergeSlot plan_in_kernel_merge(const DecodeParams& p, const DecodeKernel& k, int num_splits,
                               int row_blocks, cudaStream_t stream);

/// Records when the launch that used m ends (launched: it was queued on stream), or gives the
/// slot back untouched (not launched).
void finish_in_kernel_merge(const MergeSlot& m, cudaStream_t stream, bool launched);

}  // namespace flashserve::kernels::cuda::decode
