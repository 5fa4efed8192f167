// Public API of the CUDA forward-attention kernels, two families behind one dispatch table
// (KernelConfig::family): "sm80" (mma.sync m16n8k16, FlashAttention-2 style; runs on sm_80 and
// every later GPU) and "sm90" (wgmma + TMA + warp specialization, FlashAttention-3 style;
// compute capability 9.0 only, compiled when 90 is in FLASHSERVE_CUDA_ARCHS). On an sm_90
// device the sm90 family is offered and, where it wins, picked; elsewhere only sm80 exists.
// kernels/README.md describes both. Nothing here throws.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/dtype.h"
#include "flashserve/kernels/kernel_config.h"

namespace flashserve::kernels::cuda {

/// Head dims with compiled kernels in this build (CMake option FLASHSERVE_KERNEL_HEAD_DIMS).
std::vector<int> supported_head_dims();
/// Dtypes with compiled kernels in this build (fp16, bf16; fp32 is CPU-only).
std::vector<DType> supported_dtypes();

/// Empty when some compiled kernel can run p; otherwise a message naming the offending
/// field, e.g. "head_dim 48 is not supported by the CUDA kernels (supported: 64, 128)".
/// Checks dtype, head_dim, sizes (varlen: seqlen_q against total_q), GQA divisibility, that
/// softmax_scale_log2 is softmax_scale * log2(e), pointer/stride alignment (16 bytes), and grid
/// limits. Does not touch the GPU.
std::string supported(const AttentionParams& p);

/// The autotuner's search space for one problem class: every compiled configuration for
/// (dtype, head_dim) that the current device can run, the heuristic default first (on an
/// sm_90 device the sm90 configurations come first, then the sm80 ones). Empty when (dtype,
/// head_dim) is unsupported.
std::vector<KernelConfig> candidates(DType dtype, int head_dim, bool causal);

/// The heuristic default configuration for p on a GPU with sm_count multiprocessors
/// (the one run(p, stream) uses). Always one of candidates(p.dtype, p.head_dim, p.causal)
/// when supported(p) is empty. On an sm_90 device: an sm90 configuration unless the problem
/// has less than half a wave of 128-row tiles or a q/k/v/o layout TMA cannot describe (a zero
/// or negative stride over more than one row, head or batch); the sm80 family otherwise.
KernelConfig select(const AttentionParams& p, int sm_count);

/// Computes attention for p with configuration cfg on stream (asynchronous).
///   q: [batch, seqlen_q, heads_q, head_dim], k/v: [batch, seqlen_k, heads_kv, head_dim],
///   o: [batch, seqlen_q, heads_q, head_dim] (p.dtype), lse: [batch, heads_q, seqlen_q] fp32
///   contiguous or nullptr. Strides come from p (last dimension contiguous). With
///   p.cu_seqlens_q/k set: packed variable-length sequences (attention_params.h), compiled for one
///   sm80 configuration per (dtype, head_dim), the one select() returns for such p; any other cfg
///   gives cudaErrorInvalidValue.
/// Returns cudaErrorInvalidValue when supported(p) is not empty, cfg is not compiled for
/// (p.dtype, p.head_dim) or not runnable on this device, or cfg is an sm90 configuration and
/// p's layout is one TMA cannot describe (see select()); otherwise the launch's error
/// (cudaSuccess when it was queued).
cudaError_t run(const AttentionParams& p, const KernelConfig& cfg, cudaStream_t stream);

/// Whether run(p, cfg, stream) gets past its checks: supported(p) is empty and cfg is compiled
/// for (p.dtype, p.head_dim), runs on this device and can run p (layout, variable lengths). For a
/// caller holding a configuration chosen for another problem (a tuned one): else use select().
bool runnable(const AttentionParams& p, const KernelConfig& cfg);

/// Same as run(p, select(p, <current device's SM count>), stream).
cudaError_t run(const AttentionParams& p, cudaStream_t stream);

/// Test hook: queues a kernel that executes a trap instruction, which leaves the context with a
/// sticky error (cudaErrorLaunchFailure / illegal instruction) once it runs.
cudaError_t launch_fault_for_testing(cudaStream_t stream);
/// Test hook: a one-thread kernel that spins for `seconds` (a launch the device does not complete
/// in any useful time, without faulting), so tests can check how the server's shutdown copes.
cudaError_t launch_hang_for_testing(cudaStream_t stream, int seconds);

}  // namespace flashserve::kernels::cuda
