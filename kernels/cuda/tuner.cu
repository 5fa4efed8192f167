// Kernel-side autotuner (tuner.h): times every candidate configuration of the forward kernel on
// one problem with the kernel benchmark's method (CUDA events, warm-up, median, input sets
// rotated so that their total exceeds L2, random inputs), after checking each candidate's output
// against the default configuration's. Owns every resource it creates (RAII guards below), so no
// path leaks device memory or events; never throws.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "flashserve/kernels/cuda_attention.h"
#include "flashserve/kernels/tuner.h"
#include "tune_timing.h"

namespace flashserve::kernels::cuda {
namespace {

// ---- device helpers ---------------------------------------------------------------------------

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Fills n 16-bit elements with uniform values in [-sqrt(3), sqrt(3)) (variance 1, like randn),
/// a different stream per seed. Never zeros: zeros hide unwritten outputs and run faster.
template <typename Element>
__global__ void fill_uniform_kernel(Element* out, size_t n, uint64_t seed) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t r = splitmix64(seed ^ (i * 0xD1B54A32D192ED03ull));
    const float u = float(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    const float x = (2.f * u - 1.f) * 1.7320508f;
    if constexpr (std::is_same_v<Element, __half>) {
      out[i] = __float2half_rn(x);
    } else {
      out[i] = __float2bfloat16_rn(x);
    }
  }
}

/// stats[0] = max |ref| (float bits), stats[1] = max |out - ref| (float bits),
/// stats[2] = number of non-finite outputs. Non-negative floats order like their bit patterns.
template <typename Element>
__global__ void compare_kernel(const Element* ref, const Element* out, size_t n,
                               unsigned int* stats) {
  float max_ref = 0.f, max_diff = 0.f;
  unsigned int bad = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float r, o;
    if constexpr (std::is_same_v<Element, __half>) {
      r = __half2float(ref[i]);
      o = __half2float(out[i]);
    } else {
      r = __bfloat162float(ref[i]);
      o = __bfloat162float(out[i]);
    }
    if (!isfinite(o) || !isfinite(r)) {
      ++bad;
      continue;
    }
    max_ref = fmaxf(max_ref, fabsf(r));
    max_diff = fmaxf(max_diff, fabsf(o - r));
  }
  for (int off = 16; off > 0; off /= 2) {
    max_ref = fmaxf(max_ref, __shfl_xor_sync(0xffffffffu, max_ref, off));
    max_diff = fmaxf(max_diff, __shfl_xor_sync(0xffffffffu, max_diff, off));
    bad += __shfl_xor_sync(0xffffffffu, bad, off);
  }
  if (threadIdx.x % 32 == 0) {
    atomicMax(&stats[0], __float_as_uint(max_ref));
    atomicMax(&stats[1], __float_as_uint(max_diff));
    if (bad) atomicAdd(&stats[2], bad);
  }
}

constexpr int kHelperThreads = 256;
constexpr int kHelperBlocks = 1024;

cudaError_t fill_random(DType dtype, void* ptr, size_t elems, uint64_t seed, cudaStream_t stream) {
  if (elems == 0) return cudaSuccess;
  if (dtype == DType::kFloat16) {
    fill_uniform_kernel<<<kHelperBlocks, kHelperThreads, 0, stream>>>(static_cast<__half*>(ptr),
                                                                      elems, seed);
  } else {
    fill_uniform_kernel<<<kHelperBlocks, kHelperThreads, 0, stream>>>(
        static_cast<__nv_bfloat16*>(ptr), elems, seed);
  }
  return cudaGetLastError();
}

cudaError_t compare(DType dtype, const void* ref, const void* out, size_t elems,
                    unsigned int* stats, cudaStream_t stream) {
  if (cudaError_t err = cudaMemsetAsync(stats, 0, 4 * sizeof(unsigned int), stream);
      err != cudaSuccess)
    return err;
  if (elems == 0) return cudaSuccess;
  if (dtype == DType::kFloat16) {
    compare_kernel<<<kHelperBlocks, kHelperThreads, 0, stream>>>(
        static_cast<const __half*>(ref), static_cast<const __half*>(out), elems, stats);
  } else {
    compare_kernel<<<kHelperBlocks, kHelperThreads, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(ref), static_cast<const __nv_bfloat16*>(out), elems,
        stats);
  }
  return cudaGetLastError();
}

// ---- owned resources --------------------------------------------------------------------------

struct DeviceAllocation {
  void* ptr = nullptr;
  DeviceAllocation() = default;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation() {
    if (ptr != nullptr) cudaFree(ptr);
  }
};

struct PinnedStats {
  unsigned int* ptr = nullptr;
  PinnedStats() = default;
  PinnedStats(const PinnedStats&) = delete;
  PinnedStats& operator=(const PinnedStats&) = delete;
  ~PinnedStats() {
    if (ptr != nullptr) cudaFreeHost(ptr);
  }
};

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

/// One input/output set inside the single tuner allocation.
struct Set {
  void* q;
  void* k;
  void* v;
  void* o;
  float* lse;
};

// Units in the last place at 1.0: 2^-7 for bf16, 2^-10 for fp16. Outputs of two configurations
// differ by the order of fp32 sums and by where P is rounded to the element type; a few ulps
// of max |O| covers that, a wrong result (or a race) does not fit in it.
constexpr double kToleranceUlps = 4;
double dtype_epsilon(DType dtype) { return dtype == DType::kFloat16 ? 0x1p-10 : 0x1p-7; }

cudaError_t tune_impl(const AttentionParams& problem, cudaStream_t stream,
                      const TuneOptions& options, TuneReport* report) {
  // Validate with the problem's sizes and strides and dummy (aligned, non-null) pointers.
  AttentionParams check = problem;
  alignas(16) static char dummy[16];
  check.q = check.k = check.v = dummy;
  check.o = dummy;
  check.lse = nullptr;
  if (!supported(check).empty()) return cudaErrorInvalidValue;
  if (problem.batch == 0 || problem.seqlen_q == 0) return cudaErrorInvalidValue;  // nothing to time
  if (options.warmup < 0 || options.repetitions < 20) return cudaErrorInvalidValue;

  const std::vector<KernelConfig> configs =
      candidates(problem.dtype, problem.head_dim, problem.causal);
  if (configs.empty()) return cudaErrorInvalidValue;

  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  int sm_count = 0, l2_bytes = 0;
  if (cudaError_t err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
      err != cudaSuccess)
    return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
      err != cudaSuccess)
    return err;

  // The tuner's own contiguous problem (the caller's pointers and strides are not used).
  AttentionParams p = make_contiguous_params(problem.dtype, problem.batch, problem.seqlen_q,
                                             problem.seqlen_k, problem.heads_q, problem.heads_kv,
                                             problem.head_dim, problem.causal,
                                             problem.softmax_scale);
  p.softmax_scale_log2 = problem.softmax_scale_log2;
  report->default_config = select(p, sm_count);
  report->timings.resize(configs.size());
  for (size_t i = 0; i < configs.size(); ++i) {
    report->timings[i].config = configs[i];
    if (configs[i] == report->default_config) report->default_index = int(i);
  }
  if (report->default_index < 0) return cudaErrorInvalidValue;  // select() outside candidates()

  // Layout: a reference output, a stats word block, then n sets of (q, k, v, o, lse).
  const size_t elem = dtype_size(p.dtype);
  const size_t q_elems = size_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  const size_t kv_elems = size_t(p.batch) * p.seqlen_k * p.heads_kv * p.head_dim;
  const size_t lse_elems = size_t(p.batch) * p.heads_q * p.seqlen_q;
  const size_t q_bytes = align_up(q_elems * elem), kv_bytes = align_up(kv_elems * elem);
  const size_t lse_bytes = align_up(lse_elems * sizeof(float));
  const size_t set_bytes = 2 * q_bytes + 2 * kv_bytes + lse_bytes;
  const size_t fixed_bytes = q_bytes + kAlign;
  // Enough sets that one full rotation exceeds both L2 (twice) and rotate_bytes, but no more
  // than there are launches in all, and no more than fits in 90% of free memory.
  const size_t rotate_target = std::max(options.rotate_bytes, 2 * size_t(l2_bytes));
  size_t num_sets = std::max<size_t>(2, (rotate_target + set_bytes - 1) / set_bytes);
  num_sets = std::min(num_sets, size_t(options.warmup + options.repetitions) * configs.size());
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes); err != cudaSuccess) return err;
  const size_t usable = free_bytes / 10 * 9;
  if (usable < fixed_bytes + set_bytes) return cudaErrorMemoryAllocation;
  num_sets = std::max<size_t>(1, std::min(num_sets, (usable - fixed_bytes) / set_bytes));

  DeviceAllocation memory;
  if (cudaMalloc(&memory.ptr, fixed_bytes + num_sets * set_bytes) != cudaSuccess) {
    memory.ptr = nullptr;
    cudaGetLastError();  // clear the (non-sticky) allocation error
    return cudaErrorMemoryAllocation;
  }
  PinnedStats host_stats;
  if (cudaError_t err = cudaMallocHost(&host_stats.ptr, 4 * sizeof(unsigned int));
      err != cudaSuccess) {
    host_stats.ptr = nullptr;
    return err;
  }
  char* base = static_cast<char*>(memory.ptr);
  void* ref_out = base;
  auto* stats = reinterpret_cast<unsigned int*>(base + q_bytes);
  std::vector<Set> sets(num_sets);
  for (size_t s = 0; s < num_sets; ++s) {
    char* b = base + fixed_bytes + s * set_bytes;
    sets[s] = {b, b + q_bytes, b + q_bytes + kv_bytes, b + q_bytes + 2 * kv_bytes,
               reinterpret_cast<float*>(b + 2 * q_bytes + 2 * kv_bytes)};
    const uint64_t seed = 0x5EEDull + 3 * s;
    if (cudaError_t err = fill_random(p.dtype, sets[s].q, q_elems, seed, stream); err != cudaSuccess)
      return err;
    if (cudaError_t err = fill_random(p.dtype, sets[s].k, kv_elems, seed + 1, stream);
        err != cudaSuccess)
      return err;
    if (cudaError_t err = fill_random(p.dtype, sets[s].v, kv_elems, seed + 2, stream);
        err != cudaSuccess)
      return err;
  }
  auto params_for = [&](const Set& s) {
    AttentionParams x = p;
    x.q = s.q;
    x.k = s.k;
    x.v = s.v;
    x.o = s.o;
    x.lse = s.lse;
    return x;
  };

  // Correctness: the default's output on set 0 is the reference; every candidate (the default
  // included: NaN/unwritten check) runs on set 0 with a NaN-poisoned output and is compared.
  const AttentionParams p0 = params_for(sets[0]);
  auto run_checked = [&](const KernelConfig& cfg, CandidateTiming* t) -> cudaError_t {
    if (cudaError_t err = cudaMemsetAsync(p0.o, 0xFF, q_elems * elem, stream); err != cudaSuccess)
      return err;
    if (cudaError_t err = run(p0, cfg, stream); err != cudaSuccess) {
      t->ok = false;
      t->error = std::string("launch failed: ") + cudaGetErrorString(err);
      cudaGetLastError();
      // A sticky error (the context is unusable) ends the tuning; a launch error does not.
      return cudaStreamSynchronize(stream);
    }
    t->ok = true;
    return cudaSuccess;
  };
  CandidateTiming& def = report->timings[report->default_index];
  if (cudaError_t err = run_checked(report->default_config, &def); err != cudaSuccess) return err;
  if (!def.ok) return cudaErrorLaunchFailure;  // nothing to check the others against
  if (cudaError_t err = cudaMemcpyAsync(ref_out, p0.o, q_elems * elem, cudaMemcpyDeviceToDevice,
                                        stream);
      err != cudaSuccess)
    return err;
  const double eps = dtype_epsilon(p.dtype);
  for (size_t i = 0; i < configs.size(); ++i) {
    CandidateTiming& t = report->timings[i];
    if (int(i) != report->default_index) {
      if (cudaError_t err = run_checked(configs[i], &t); err != cudaSuccess) return err;
      if (!t.ok) continue;
    }
    if (cudaError_t err = compare(p.dtype, ref_out, p0.o, q_elems, stats, stream);
        err != cudaSuccess)
      return err;
    if (cudaError_t err = cudaMemcpyAsync(host_stats.ptr, stats, 4 * sizeof(unsigned int),
                                          cudaMemcpyDeviceToHost, stream);
        err != cudaSuccess)
      return err;
    if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) return err;
    float max_ref = 0, max_diff = 0;
    std::memcpy(&max_ref, &host_stats.ptr[0], sizeof(float));
    std::memcpy(&max_diff, &host_stats.ptr[1], sizeof(float));
    t.max_abs_diff = max_diff;
    const double tolerance = kToleranceUlps * eps * max_ref;
    if (host_stats.ptr[2] != 0) {
      t.ok = false;
      t.error = std::to_string(host_stats.ptr[2]) + " NaN/Inf (or unwritten) output elements";
    } else if (max_diff > tolerance) {
      t.ok = false;
      t.error = "output differs from " + report->default_config.name() + "'s by " +
                std::to_string(max_diff) + " (tolerance " + std::to_string(tolerance) + ")";
    }
  }
  if (!def.ok) return cudaErrorLaunchFailure;  // the default's own output was not finite

  // Timing. Candidates are interleaved per repetition (each round launches every ok candidate
  // once), so clock or thermal drift during tuning affects all of them alike.
  std::vector<int> live;
  for (size_t i = 0; i < configs.size(); ++i)
    if (report->timings[i].ok) live.push_back(int(i));
  size_t next_set = 0;
  std::vector<double> medians;
  auto launch = [&](int c) {
    return run(params_for(sets[next_set++ % num_sets]), configs[live[c]], stream);
  };
  if (cudaError_t err = time_interleaved(int(live.size()), options.warmup, options.repetitions,
                                         stream, launch, &medians);
      err != cudaSuccess)
    return err;
  const double flops = attention_flops(p);
  for (size_t c = 0; c < live.size(); ++c) {
    CandidateTiming& t = report->timings[live[c]];
    t.median_ms = medians[c];
    t.tflops = t.median_ms > 0 ? flops / (t.median_ms * 1e-3) / 1e12 : 0;
  }
  for (int i : live) {
    const double m = report->timings[i].median_ms;
    if (report->best < 0 || m < report->timings[report->best].median_ms) {
      report->runner_up = report->best;
      report->best = i;
    } else if (report->runner_up < 0 || m < report->timings[report->runner_up].median_ms) {
      report->runner_up = i;
    }
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t tune(const AttentionParams& problem, cudaStream_t stream, const TuneOptions& options,
                 TuneReport* report) {
  if (report == nullptr) return cudaErrorInvalidValue;
  *report = TuneReport{};
  try {
    const cudaError_t err = tune_impl(problem, stream, options, report);
    if (err != cudaSuccess) report->best = report->runner_up = -1;
    return err;
  } catch (const std::bad_alloc&) {
    report->best = report->runner_up = -1;
    return cudaErrorMemoryAllocation;
  } catch (...) {
    report->best = report->runner_up = -1;
    return cudaErrorUnknown;
  }
}

}  // namespace flashserve::kernels::cuda
