// cpu::attention_forward: picks the tile kernel for this CPU once, splits the problem into
// (query block, batch, head) tasks and runs them on the thread pool until done or stopped.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashserve/kernels/cpu_attention.h"
#include "tile_kernel.h"

namespace flashserve::kernels::cpu {
namespace {

TileKernel kernel_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return tile_kernel_avx512();
    case Isa::kAvx2:
      return tile_kernel_avx2();
    case Isa::kScalar:
      break;
  }
  return tile_kernel_scalar();
}

// Per-thread scratch, grown on demand and kept for the thread's lifetime, 64-byte aligned.
float* thread_workspace(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats + 16) buffer.resize(floats + 16);
  const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kScalar:
      break;
  }
  return "scalar";
}

bool isa_available(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && isa_available(Isa::kAvx2);
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kScalar:
      return true;
  }
  return false;
}

Isa best_isa() {
  static const Isa best = isa_available(Isa::kAvx512) ? Isa::kAvx512
                          : isa_available(Isa::kAvx2) ? Isa::kAvx2
                                                      : Isa::kScalar;
  return best;
}

bool attention_forward_isa(const AttentionParams& p, ThreadPool* pool, Isa isa, StopSignal* stop) {
  const TileKernel kernel = kernel_for(isa);
  const int blocks = (p.seqlen_q + kernel.block_q - 1) / kernel.block_q;
  const int64_t heads = int64_t{p.batch} * p.heads_q;
  const int64_t tasks = heads * blocks;
  const size_t workspace_floats = kernel.workspace_floats(p.head_dim);
  // Block-major order with the last query blocks first: under causal masking they see the most
  // keys, so the long tasks start early and the short ones fill in at the end.
  const auto task = [&](int64_t t) {
    const int block = blocks - 1 - static_cast<int>(t / heads);
    const int64_t bh = t % heads;
    const int q0 = block * kernel.block_q;
    return kernel.run(p, static_cast<int>(bh / p.heads_q), static_cast<int>(bh % p.heads_q), q0,
                      std::min(kernel.block_q, p.seqlen_q - q0), thread_workspace(workspace_floats),
                      stop);
  };
  if (pool != nullptr && pool->num_threads() > 1 && tasks > 1) {
    pool->parallel_for_while(tasks, task);
  } else {
    for (int64_t t = 0; t < tasks; ++t) {
      if (!task(t)) return false;
    }
  }
  // A task that saw the stop left the rest unrun; the signal stays set once seen.
  return stop == nullptr || !stop->stop_requested();
}

void attention_forward(const AttentionParams& p, ThreadPool* pool) {
  attention_forward_isa(p, pool, best_isa());
}

bool attention_forward(const AttentionParams& p, ThreadPool* pool, StopSignal* stop) {
  return attention_forward_isa(p, pool, best_isa(), stop);
}

}  // namespace flashserve::kernels::cpu
