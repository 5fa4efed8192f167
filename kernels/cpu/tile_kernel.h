// Internal interface between the CPU attention driver and its per-ISA tile kernels.
#pragma once

#include <cstddef>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cpu_attention.h"

namespace flashserve::kernels::cpu {

/// Instruction sets with a tile kernel. kScalar is portable C++ and runs anywhere.
enum class Isa { kScalar, kAvx2, kAvx512 };

const char* isa_name(Isa isa);

/// True when this CPU (and OS) can run the kernel for isa.
bool isa_available(Isa isa);

/// The fastest available instruction set.
Isa best_isa();

/// One query block of one (batch, head): the whole online-softmax pass over its visible keys.
struct TileKernel {
  int block_q;  // query rows per block (the unit of parallel work)
  /// Scratch floats one call needs for this head_dim.
  size_t (*workspace_floats)(int head_dim);
  /// Computes rows [q0, q0 + nq) (nq <= block_q) of batch b, query head h: writes O and LSE.
  /// workspace: workspace_floats(head_dim) floats, 64-byte aligned, owned by the calling thread.
  /// Checks `stop` (may be null) before each key tile; false when it stopped (rows unwritten).
  bool (*run)(const AttentionParams& p, int b, int h, int q0, int nq, float* workspace,
              StopSignal* stop);
};

TileKernel tile_kernel_scalar();
TileKernel tile_kernel_avx2();
TileKernel tile_kernel_avx512();

/// attention_forward with an explicit instruction set (tests and benchmarks compare them).
/// Requires supported(p).empty() and isa_available(isa). False when `stop` stopped it.
bool attention_forward_isa(const AttentionParams& p, ThreadPool* pool, Isa isa,
                           StopSignal* stop = nullptr);

}  // namespace flashserve::kernels::cpu
