// All runtime -> compile-time dispatch of the forward kernels: the table of compiled
// configurations (the sm80 family expanded from the generated registry.inc; the sm90 family from
// sm90/registry.h when FLASHSERVE_HAVE_SM90), supported(), candidates(), select() and run().
// sm90 configurations are offered and picked only on a compute-capability 9.0 device.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "flash_fwd_launch.h"
#include "flashserve/kernels/cuda_attention.h"
#if FLASHSERVE_HAVE_SM90
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sm90/registry.h"
#include "sm90/tensor_map.h"
#endif

// extern template declarations of every generated instance (and of its variable-length
// launcher where VARLEN is true: the _true / _false helpers below pick by token pasting).
#define FLASHSERVE_FWD_VARLEN_DECL_false(...)
#define FLASHSERVE_FWD_VARLEN_DECL_true(...) FLASHSERVE_FWD_VARLEN_INSTANCE(extern, __VA_ARGS__)
#define FLASHSERVE_FWD_VARLEN_FN_false(...) nullptr
#define FLASHSERVE_FWD_VARLEN_FN_true(...) &launch_fwd_varlen<FLASHSERVE_FWD_TRAITS(__VA_ARGS__)>
#define FLASHSERVE_FWD_CONFIG(DTYPE, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS,    \
                              LAZY, VARLEN)                                                      \
  FLASHSERVE_FWD_INSTANCE(extern, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS, LAZY) \
  FLASHSERVE_FWD_VARLEN_DECL_##VARLEN(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS, LAZY)
#include "registry.inc"
#undef FLASHSERVE_FWD_CONFIG

namespace flashserve::kernels::cuda {
namespace {

using LaunchFn = cudaError_t (*)(const AttentionParams&, cudaStream_t);

struct Entry {
  DType dtype;
  int head_dim;
  KernelConfig config;
  LaunchFn launch;
  LaunchFn launch_varlen = nullptr;  // packed variable lengths; default configurations only
};

const Entry kEntries[] = {
#define FLASHSERVE_FWD_CONFIG(DTYPE, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS,     \
                              LAZY, VARLEN)                                                       \
  {DType::DTYPE, HEAD_DIM, KernelConfig{BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS, LAZY},              \
   &launch_fwd<FwdTraits<ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS, LAZY>>,         \
   FLASHSERVE_FWD_VARLEN_FN_##VARLEN(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, STAGES, QREGS, LAZY)},
#include "registry.inc"
#undef FLASHSERVE_FWD_CONFIG
};

#if FLASHSERVE_HAVE_SM90
const Entry kSm90Entries[] = {
// One launch function for fixed and variable lengths (launch_sm90 picks the packed variant).
#define FLASHSERVE_SM90_TRAITS(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES) \
  sm90::Sm90Traits<ELEMENT, sm90::kernel_head_dim(HEAD_DIM), BLOCK_N, STAGES, BLOCK_M / 64>
#define FLASHSERVE_SM90_ENTRY(DTYPE, ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)           \
  {DType::DTYPE, HEAD_DIM, KernelConfig::sm90(BLOCK_N, STAGES, BLOCK_M),                    \
   &sm90::launch_sm90<FLASHSERVE_SM90_TRAITS(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)>, \
   &sm90::launch_sm90<FLASHSERVE_SM90_TRAITS(ELEMENT, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)>},
    FLASHSERVE_SM90_CONFIGS(FLASHSERVE_SM90_ENTRY)
#undef FLASHSERVE_SM90_ENTRY
#undef FLASHSERVE_SM90_TRAITS
};
#endif

#if FLASHSERVE_HAVE_SM90
// Whether the current device runs sm_90a code (compute capability exactly 9.0).
bool device_is_sm90() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // no device: not an error worth keeping
    return false;
  }
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}
#endif

// The sm90 entries usable on the current device (empty elsewhere or when not compiled).
std::vector<const Entry*> sm90_entries() {
  std::vector<const Entry*> out;
#if FLASHSERVE_HAVE_SM90
  if (device_is_sm90())
    for (const Entry& e : kSm90Entries) out.push_back(&e);
#endif
  return out;
}

// Whether the sm90 kernels' tensor maps can describe p's q/k/v/o (positive, 16-byte strides).
bool sm90_can_run(const AttentionParams& p) {
#if FLASHSERVE_HAVE_SM90
  // The tensor maps need the packed rows (total_q is optional without LSE: then sm80 runs).
  if (p.varlen() && (p.total_k <= 0 || p.total_q <= 0)) return false;
  const sm90::TensorView q = sm90::q_view(p), k = sm90::k_view(p), v = sm90::v_view(p);
  return sm90::tensor_map_strides_ok(q) && sm90::tensor_map_strides_ok(sm90::o_view(p)) &&
         (p.seqlen_k == 0 || (sm90::tensor_map_strides_ok(k) && sm90::tensor_map_strides_ok(v)));
#else
  (void)p;
  return false;
#endif
}

const Entry* find_entry(DType dtype, int head_dim, const KernelConfig& cfg) {
  if (cfg.family == KernelFamily::kSm90) {
    for (const Entry* e : sm90_entries())
      if (e->dtype == dtype && e->head_dim == head_dim && e->config == cfg) return e;
    return nullptr;
  }
  for (const Entry& e : kEntries)
    if (e.dtype == dtype && e.head_dim == head_dim && e.config == cfg) return &e;
  return nullptr;
}

// Whether d=64 (and d=32, which runs the d=64 instances) takes the 192-row sm90 tiles: H100,
// same-call A/B against cuDNN (kernels-sm90-h100-2026-11-24-f.md): 1.05-1.34x at every non-causal
// point from S1024 and every causal one from S2048, where the 128-row tiles read 0.95-1.11x. Causal
// S1024 read 0.91 there (128 rows: 1.02): the 192-row tiles' row padding sat in the tile that sees
// every key. With causal 192-row tiles aligned to the sequence's end (sm90/scheduler.h), on the
// H200 (kernels-varlen-h200-2026-11-29.md, B16 H32) 192 rows lead from S768: S768 0.126 vs
// 0.130 ms, S999 0.201 vs 0.203, S1024 0.199-0.200 vs 0.202-0.203, S2000 0.607-0.612 vs
// 0.661-0.677; at S512 they trail (0.076 vs 0.072). Only with 4+ waves of 192-row tiles (every
// measured point has 23+); fewer leave SMs idle at the end.
bool sm90_block_m192_fits(const AttentionParams& p, int sm_count) {
  if (p.head_dim > 64 || (p.causal && p.seqlen_q < 768)) return false;
  const int64_t tiles = int64_t((p.seqlen_q + 191) / 192) * p.heads_q * p.batch;
  return tiles >= 4 * int64_t(sm_count);
}

// The sm90 configuration for p on this device, if any (H100 measurements in
// bench/results/kernels-sm90-h100-2026-11-24*.md). d=128: 176-key steps beat 128 only for long
// non-causal problems (S16k: 641-666 vs 631-635 TFLOPS); not for Sq1k/Sk8k (two Q buffers win
// there: 586-624 vs 683-685, file -c), so both lengths count; 128 elsewhere. d=64: 192-row
// tiles (three consumer warpgroups) where they fill the GPU (sm90_block_m192_fits).
const Entry* sm90_preferred(const AttentionParams& p, int sm_count) {
  const bool m192 = sm90_block_m192_fits(p, sm_count);
  const Entry* first = nullptr;
  for (const Entry* e : sm90_entries()) {
    if (e->dtype != p.dtype || e->head_dim != p.head_dim) continue;
    if (first == nullptr) first = e;
    if (p.head_dim == 128 && !p.causal && p.seqlen_q >= 8192 && p.seqlen_k >= 8192 &&
        e->config.block_n == 176)
      return e;
    if (m192 && e->config.block_m == 192) return e;
  }
  return first;
}

// The shortest query and key length from which sm90 beats sm80 on less than half a wave of
// 128-row tiles, per head_dim (0: never). H200, B1-B2 with 4-16 heads, Sq = Sk, 8-64 tiles, 3
// rounds (bench/results/kernels-h200-2026-11-30-small-grids.md), sm90 / sm80 speed:
// - d64: S512 0.92-1.08x, S640 0.97-1.08x, S768 1.00-1.11x, S1024 1.06-1.21x;
// - d128: S320 0.92-0.96x, S384 1.00-1.06x (causal 0.997 at worst), S512 1.06-1.13x;
// - d96 (on the d128 instance; sm80's d96 tiles spill): S256 1.07-1.14x, S1024 1.54-1.59x;
// - d256: S256 1.01-1.11x, S1024 1.35-1.42x;
// - d32 (on the d64 instance): 0.75-0.92x up to S1024, S2048 0.98-1.08x: sm80 keeps it.
int sm90_small_grid_length(int head_dim) {
  switch (head_dim) {
    case 64:
      return 768;
    case 128:
      return 384;
    case 96:
    case 256:
      return 256;
    default:
      return 0;
  }
}

// Whether sm90 beats sm80 on p: from half a wave of 128-row tiles (H100: S256 B2 H16 0.92-0.98x
// of sm80, S128 B1 0.98-1.04x; from one full wave on sm90 is 1.1x or more), or on fewer tiles
// where each is long (sm90_small_grid_length; fixed lengths only: a packed batch's maximum says
// little about its other sequences).
bool sm90_worth_it(const AttentionParams& p, int sm_count) {
  constexpr int kBlockM = 128;  // the default sm90 configurations: 2 consumer warpgroups
  const int64_t tiles = int64_t((p.seqlen_q + kBlockM - 1) / kBlockM) * p.heads_q * p.batch;
  if (sm_count <= 0 || 2 * tiles >= sm_count) return true;
  const int length = sm90_small_grid_length(p.head_dim);
  return !p.varlen() && length > 0 && std::min(p.seqlen_q, p.seqlen_k) >= length;
}

bool has_entries(DType dtype, int head_dim) {
  for (const Entry& e : kEntries)
    if (e.dtype == dtype && e.head_dim == head_dim) return true;
  return false;
}

std::string join_ints(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

// The heuristic default for a large problem, per (head_dim, causal), from the H200 sweep in
// kernels/NOTES.md: 32 query rows per warp (128 rows, 4 warps) halves the shared-memory traffic
// per MMA against 16 rows per warp (8 warps: 25% slower). d=64: one K/V stage beat two by 3%
// (smaller footprint); d=128: two stages beat one by 4-7%, and the lazy rescale (v4: no O
// rescale on most tiles, no spills) beats the exact one (NOTES.md).
KernelConfig preferred(int head_dim, bool /*causal: same choice today*/) {
  switch (head_dim) {
    case 64:
      return KernelConfig{128, 64, 4, 1, false};
    case 128:
      return KernelConfig{128, 64, 4, 2, false, true};
    case 256:
      return KernelConfig{128, 64, 8, 2, false};
    default:
      return KernelConfig{128, 64, 4, 2, false};
  }
}

constexpr int kMaxGridYZ = 65535;

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The variable-length fields (attention_params.h): empty when p is dense or a well-formed varlen
// problem. The offsets themselves live on the device and are the caller's to keep in range.
std::string varlen_problem(const AttentionParams& p) {
  if (!p.varlen()) return "";
  if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr)
    return "cu_seqlens_q and cu_seqlens_k must both be set (variable lengths) or both be null";
  if (reinterpret_cast<uintptr_t>(p.cu_seqlens_q) % alignof(int) != 0 ||
      reinterpret_cast<uintptr_t>(p.cu_seqlens_k) % alignof(int) != 0)
    return "cu_seqlens_q and cu_seqlens_k must be 4-byte aligned int32 arrays";
  if (p.total_q < 0) return "total_q must be >= 0 (got " + std::to_string(p.total_q) + ")";
  if (p.total_k < 0) return "total_k must be >= 0 (got " + std::to_string(p.total_k) + ")";
  if (p.lse != nullptr && p.total_q == 0 && p.batch > 0 && p.seqlen_q > 0)
    return "total_q (rows of the packed q) must be set when lse is requested with variable lengths";
  // seqlen_q sizes the grid: rows past a smaller bound would go uncomputed (at 0, all of them).
  if (p.total_q > 0 && (p.seqlen_q < 1 || p.total_q > int64_t{p.batch} * p.seqlen_q))
    return "seqlen_q must bound every packed sequence's rows (>= 1, batch * seqlen_q >= total_q)";
  return "";
}

// Whether softmax_scale_log2 is softmax_scale * log2(e) to float rounding: the kernels
// exponentiate with it but form the LSE with softmax_scale, the CPU backend's only scale.
bool scales_agree(const AttentionParams& p) {
  // make_contiguous_params' value passes as is (also where subnormal, rounded coarsely).
  const float derived = p.softmax_scale * 1.4426950408889634f;
  return p.softmax_scale_log2 == derived ||
         std::fabs(double(p.softmax_scale_log2) - derived) <= 1e-5 * derived;
}

// run()'s checks of cfg for p (supported(p) aside): its entry, when compiled for p, runnable on
// this device and for p's layout; else null.
const Entry* runnable_entry(const AttentionParams& p, const KernelConfig& cfg) {
  const Entry* e = find_entry(p.dtype, p.head_dim, cfg);
  if (e == nullptr) return nullptr;
  if (cfg.family == KernelFamily::kSm90 && !sm90_can_run(p)) return nullptr;
  if (p.varlen() && e->launch_varlen == nullptr) return nullptr;
  return e;
}

}  // namespace

std::vector<int> supported_head_dims() {
  std::vector<int> dims;
  for (const Entry& e : kEntries) {
    bool seen = false;
    for (int d : dims) seen |= d == e.head_dim;
    if (!seen) dims.push_back(e.head_dim);
  }
  return dims;
}

std::vector<DType> supported_dtypes() {
  std::vector<DType> dtypes;
  for (const Entry& e : kEntries) {
    bool seen = false;
    for (DType d : dtypes) seen |= d == e.dtype;
    if (!seen) dtypes.push_back(e.dtype);
  }
  return dtypes;
}

std::string supported(const AttentionParams& p) {
  const std::vector<DType> dtypes = supported_dtypes();
  bool dtype_ok = false;
  std::string dtype_list;
  for (DType d : dtypes) {
    dtype_ok |= d == p.dtype;
    dtype_list += (dtype_list.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  if (!dtype_ok)
    return "dtype " + std::string(dtype_name(p.dtype)) +
           " is not supported by the CUDA kernels (supported: " + dtype_list + ")";
  const std::vector<int> dims = supported_head_dims();
  bool dim_ok = false;
  for (int d : dims) dim_ok |= d == p.head_dim;
  if (!dim_ok)
    return "head_dim " + std::to_string(p.head_dim) +
           " is not supported by the CUDA kernels (supported: " + join_ints(dims) + ")";
  if (!has_entries(p.dtype, p.head_dim))
    return "no CUDA kernel was compiled for dtype " + std::string(dtype_name(p.dtype)) +
           " with head_dim " + std::to_string(p.head_dim);
  if (p.batch < 0) return "batch must be >= 0 (got " + std::to_string(p.batch) + ")";
  if (p.batch > kMaxGridYZ)
    return "batch " + std::to_string(p.batch) + " exceeds the CUDA kernels' limit of 65535";
  if (p.seqlen_q < 0) return "seqlen_q must be >= 0 (got " + std::to_string(p.seqlen_q) + ")";
  if (p.seqlen_k < 0) return "seqlen_k must be >= 0 (got " + std::to_string(p.seqlen_k) + ")";
  if (p.heads_q < 1) return "heads_q must be >= 1 (got " + std::to_string(p.heads_q) + ")";
  if (p.heads_q > kMaxGridYZ)
    return "heads_q " + std::to_string(p.heads_q) + " exceeds the CUDA kernels' limit of 65535";
  if (p.heads_kv < 1) return "heads_kv must be >= 1 (got " + std::to_string(p.heads_kv) + ")";
  if (p.heads_q % p.heads_kv != 0)
    return "heads_q (" + std::to_string(p.heads_q) + ") must be a multiple of heads_kv (" +
           std::to_string(p.heads_kv) + ")";
  if (!(p.softmax_scale > 0.f) || !std::isfinite(p.softmax_scale))
    return "softmax_scale must be positive and finite";
  if (!(p.softmax_scale_log2 > 0.f) || !std::isfinite(p.softmax_scale_log2))
    return "softmax_scale_log2 must be positive and finite (softmax_scale * log2(e))";
  if (!scales_agree(p))
    return "softmax_scale_log2 must be softmax_scale * log2(e) (make_contiguous_params sets both)";
  if (std::string why = varlen_problem(p); !why.empty()) return why;
  if (p.batch == 0 || p.seqlen_q == 0) return "";  // nothing to compute
  if (p.q == nullptr || p.o == nullptr) return "q and o must not be null";
  if (p.seqlen_k > 0 && (p.k == nullptr || p.v == nullptr)) return "k and v must not be null";
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v) || !aligned16(p.o))
    return "q, k, v and o must be 16-byte aligned";
  const int64_t strides[] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                             p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                             p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                             p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  for (int64_t s : strides)
    if (s % 8 != 0)
      return "every batch/row/head stride must be a multiple of 8 elements (16 bytes); got " +
             std::to_string(s);
  return "";
}

std::vector<KernelConfig> candidates(DType dtype, int head_dim, bool causal) {
  std::vector<KernelConfig> out;
  if (!has_entries(dtype, head_dim)) return out;
  // On sm_90 the sm90 family comes first (the heuristic default for large problems).
  for (const Entry* e : sm90_entries())
    if (e->dtype == dtype && e->head_dim == head_dim) out.push_back(e->config);
  const KernelConfig first = preferred(head_dim, causal);
  if (find_entry(dtype, head_dim, first) != nullptr) out.push_back(first);
  for (const Entry& e : kEntries)
    if (e.dtype == dtype && e.head_dim == head_dim && e.config != first) out.push_back(e.config);
  return out;
}

namespace {
// The sm80 family's heuristic choice (below: select() prefers sm90 where it wins).
KernelConfig select_sm80(const AttentionParams& p, int sm_count);
}  // namespace

KernelConfig select(const AttentionParams& p, int sm_count) {
  const Entry* e = sm90_preferred(p, sm_count);
  if (e != nullptr && sm90_can_run(p) && sm90_worth_it(p, sm_count)) return e->config;
  return select_sm80(p, sm_count);
}

namespace {
KernelConfig select_sm80(const AttentionParams& p, int sm_count) {
  if (!has_entries(p.dtype, p.head_dim)) return preferred(p.head_dim, p.causal);
  if (p.varlen()) {  // the one configuration with a variable-length kernel
    for (const Entry& e : kEntries)
      if (e.dtype == p.dtype && e.head_dim == p.head_dim && e.launch_varlen != nullptr)
        return e.config;
  }
  KernelConfig best = preferred(p.head_dim, p.causal);
  if (find_entry(p.dtype, p.head_dim, best) == nullptr) {
    for (const Entry& e : kEntries)
      if (e.dtype == p.dtype && e.head_dim == p.head_dim) {
        best = e.config;
        break;
      }
  }
  // d=64 with short queries: keeping Q in registers (m128n64w4s2q) was the tuner's pick at every
  // seqlen_q <= 1024 point of the H200 grid (+2 to +5%, bench/results/autotune-h200-2026-11-22.md).
  if (p.head_dim == 64 && p.seqlen_q <= 1024) {
    const KernelConfig q_in_regs{128, 64, 4, 2, true};
    if (find_entry(p.dtype, p.head_dim, q_in_regs) != nullptr) best = q_in_regs;
  }
  // Too few 128-row tiles to fill every multiprocessor once: 64-row tiles double the blocks.
  const int64_t tiles = int64_t((p.seqlen_q + best.block_m - 1) / best.block_m) * p.heads_q * p.batch;
  if (sm_count > 0 && tiles < sm_count) {
    const KernelConfig small{64, 64, 4, 2, false};
    if (find_entry(p.dtype, p.head_dim, small) != nullptr) best = small;
  }
  return best;
}
}  // namespace

bool runnable(const AttentionParams& p, const KernelConfig& cfg) {
  return supported(p).empty() && runnable_entry(p, cfg) != nullptr;
}

cudaError_t run(const AttentionParams& p, const KernelConfig& cfg, cudaStream_t stream) {
  if (!supported(p).empty()) return cudaErrorInvalidValue;
  const Entry* e = runnable_entry(p, cfg);
  if (e == nullptr) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;
  return p.varlen() ? e->launch_varlen(p, stream) : e->launch(p, stream);
}

cudaError_t run(const AttentionParams& p, cudaStream_t stream) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  int sm_count = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess)
    return err;
  return run(p, select(p, sm_count), stream);
}

}  // namespace flashserve::kernels::cuda
