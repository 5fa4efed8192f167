// Split-count autotuner of the decode kernels (tune_decode_splits in tuner.h): times every count
// of decode_split_candidates() on the tuner's own random inputs (the caller's sizes, dense or
// paged like the caller's problem), after checking each count's output against the heuristic's.
// Same method as tune() in tuner.cu, whose timing loop it shares (tune_timing.h): CUDA events,
// warm-up, median, candidates interleaved, input sets rotated over max(rotate_bytes, 2x L2).
// Owns everything it allocates; never throws.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashserve/kernels/decode_attention.h"
#include "flashserve/kernels/tuner.h"
#include "tune_timing.h"

namespace flashserve::kernels::cuda {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Uniform values in [-sqrt(3), sqrt(3)) (variance 1), never all zeros.
template <typename Element>
__global__ void decode_fill_kernel(Element* out, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float u = float(mix64(seed ^ (i * 0xD1B54A32D192ED03ull)) >> 40) * (1.0f / 16777216.0f);
    const float x = (2.f * u - 1.f) * 1.7320508f;
    if constexpr (std::is_same_v<Element, __half>)
      out[i] = __float2half_rn(x);
    else
      out[i] = __float2bfloat16_rn(x);
  }
}

/// stats[0] = max |ref|, stats[1] = max |out - ref| (float bits), stats[2] = non-finite count.
template <typename Element>
__global__ void decode_compare_kernel(const Element* ref, const Element* out, size_t n,
                                      unsigned int* stats) {
  float max_ref = 0.f, max_diff = 0.f;
  unsigned int bad = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float r = float(ref[i]), o = float(out[i]);
    if (!isfinite(o) || !isfinite(r)) {
      ++bad;
      continue;
    }
    max_ref = fmaxf(max_ref, fabsf(r));
    max_diff = fmaxf(max_diff, fabsf(o - r));
  }
  atomicMax(&stats[0], __float_as_uint(max_ref));
  atomicMax(&stats[1], __float_as_uint(max_diff));
  if (bad) atomicAdd(&stats[2], bad);
}

cudaError_t fill(DType dtype, void* ptr, size_t n, uint64_t seed, cudaStream_t stream) {
  if (dtype == DType::kFloat16)
    decode_fill_kernel<<<512, 256, 0, stream>>>(static_cast<__half*>(ptr), n, seed);
  else
    decode_fill_kernel<<<512, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(ptr), n, seed);
  return cudaGetLastError();
}

/// Compares out with ref on the stream and returns (max |ref|, max diff, non-finite count).
cudaError_t compare(DType dtype, const void* ref, const void* out, size_t n, unsigned int* stats,
                    unsigned int* host, cudaStream_t stream) {
  if (cudaError_t err = cudaMemsetAsync(stats, 0, 3 * sizeof(unsigned int), stream); err)
    return err;
  if (dtype == DType::kFloat16)
    decode_compare_kernel<<<512, 256, 0, stream>>>(static_cast<const __half*>(ref),
                                                   static_cast<const __half*>(out), n, stats);
  else
    decode_compare_kernel<<<512, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(ref), static_cast<const __nv_bfloat16*>(out), n, stats);
  if (cudaError_t err = cudaGetLastError(); err) return err;
  if (cudaError_t err =
          cudaMemcpyAsync(host, stats, 3 * sizeof(unsigned int), cudaMemcpyDeviceToHost, stream);
      err)
    return err;
  return cudaStreamSynchronize(stream);
}

struct Owned {  // device and pinned allocations: released on every path
  std::vector<void*> device;
  unsigned int* host = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    for (void* p : device) cudaFree(p);
    if (host != nullptr) cudaFreeHost(host);
  }
  cudaError_t alloc(size_t bytes, void** out) {
    if (cudaMalloc(out, std::max<size_t>(bytes, 256)) != cudaSuccess) {
      cudaGetLastError();  // not sticky
      return cudaErrorMemoryAllocation;
    }
    device.push_back(*out);
    return cudaSuccess;
  }
};

constexpr double kToleranceUlps = 4;  // as tune(): rounding of other split counts fits in it

/// The tuner's problem: the caller's sizes, contiguous dense K/V, or (when the caller's problem
/// is paged) a page pool in shuffled pages with the caller's page size. Fixed lengths.
DecodeParams tuner_problem(const DecodeParams& c) {
  DecodeParams p =
      make_dense_decode_params(c.dtype, c.batch, std::max(c.seqlen_q, 1), c.seqlen_k, c.heads_q,
                               c.heads_kv, c.head_dim, c.causal, c.softmax_scale);
  if (c.block_table != nullptr) {
    p.page_size = c.page_size;
    p.block_table_stride = (int64_t{c.seqlen_k} + c.page_size - 1) / c.page_size;
    p.k_batch_stride = p.v_batch_stride = int64_t{c.page_size} * p.k_row_stride;
  }
  return p;
}

struct Inputs {
  std::vector<DecodeParams> sets;  // each with its own q, k, v, o
  size_t out_elems = 0;
  void* reference = nullptr;
  unsigned int* stats = nullptr;
};

/// Allocates and fills the rotated input sets (+ lengths, block table, workspace, reference).
cudaError_t make_inputs(const DecodeParams& p, int max_splits, const TuneOptions& o, Owned& own,
                        cudaStream_t stream, Inputs* in) {
  const bool paged = p.page_size > 0;
  const size_t elem = 2, pages = paged ? size_t(p.batch) * p.block_table_stride : 0;
  const size_t q_elems = size_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  const size_t kv_elems = paged ? pages * p.k_batch_stride : size_t(p.batch) * p.k_batch_stride;
  const size_t set_bytes = 2 * q_elems * elem + 2 * kv_elems * elem;
  int device = 0, l2 = 0;
  if (cudaError_t err = cudaGetDevice(&device); err) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device); err)
    return err;
  size_t free_bytes = 0, total = 0;
  if (cudaError_t err = cudaMemGetInfo(&free_bytes, &total); err) return err;
  const size_t target = std::max(o.rotate_bytes, 2 * size_t(l2));
  size_t n = std::max<size_t>(1, (target + set_bytes - 1) / set_bytes);
  n = std::min(n, free_bytes / 10 * 8 / std::max<size_t>(set_bytes, 1));
  if (n == 0) return cudaErrorMemoryAllocation;
  void *lengths = nullptr, *table = nullptr, *workspace = nullptr, *stats = nullptr;
  const size_t ws = decode_workspace_bytes(p, max_splits);
  for (auto [bytes, ptr] : {std::pair{size_t(p.batch) * 4, &lengths}, std::pair{pages * 4, &table},
                            std::pair{ws, &workspace}, std::pair{q_elems * elem, &in->reference},
                            std::pair{size_t(16), &stats}})
    if (cudaError_t err = own.alloc(bytes, ptr); err) return err;
  in->stats = static_cast<unsigned int*>(stats);
  std::vector<int32_t> host_len(p.batch, p.seqlen_k), host_table(pages);
  std::iota(host_table.begin(), host_table.end(), 0);
  std::shuffle(host_table.begin(), host_table.end(), std::mt19937(12345));
  if (cudaError_t err = cudaMemcpy(lengths, host_len.data(), p.batch * 4, cudaMemcpyHostToDevice);
      err)
    return err;
  if (paged)
    if (cudaError_t err = cudaMemcpy(table, host_table.data(), pages * 4, cudaMemcpyHostToDevice);
        err)
      return err;
  for (size_t s = 0; s < n; ++s) {
    DecodeParams x = p;
    void *q, *k, *v, *out;
    for (auto [bytes, ptr] : {std::pair{q_elems * elem, &q}, std::pair{kv_elems * elem, &k},
                              std::pair{kv_elems * elem, &v}, std::pair{q_elems * elem, &out}})
      if (cudaError_t err = own.alloc(bytes, ptr); err) return err;
    for (auto [ptr, count, seed] :
         {std::tuple{q, q_elems, 3 * s}, std::tuple{k, kv_elems, 3 * s + 1},
          std::tuple{v, kv_elems, 3 * s + 2}})
      if (cudaError_t err = fill(p.dtype, ptr, count, 0xDEC0DEull + seed, stream); err) return err;
    x.q = q, x.k = k, x.v = v, x.o = out;
    if (paged)
      x.seqlens_k = static_cast<int32_t*>(lengths), x.block_table = static_cast<int32_t*>(table);
    x.workspace = workspace, x.workspace_bytes = ws;
    in->sets.push_back(x);
  }
  in->out_elems = q_elems;
  return cudaStreamSynchronize(stream);
}

/// Runs every candidate once on set 0 (NaN-poisoned output) and checks it against the
/// heuristic's output (report->timings[heuristic_index], which runs first).
cudaError_t check_candidates(const Inputs& in, Owned& own, cudaStream_t stream,
                             DecodeTuneReport* r) {
  const DecodeParams& p0 = in.sets[0];
  const double eps = p0.dtype == DType::kFloat16 ? 0x1p-10 : 0x1p-7;
  std::vector<size_t> order(r->timings.size());
  std::iota(order.begin(), order.end(), 0);
  std::swap(order[0], order[r->heuristic_index]);
  for (size_t i : order) {
    DecodeSplitTiming& t = r->timings[i];
    DecodeParams x = p0;
    x.num_splits = t.num_splits;
    if (cudaError_t err = cudaMemsetAsync(x.o, 0xFF, in.out_elems * 2, stream); err) return err;
    if (cudaError_t err = run_decode(x, stream); err != cudaSuccess) {
      t.error = std::string("launch failed: ") + cudaGetErrorString(err);
      cudaGetLastError();
      if (cudaError_t sticky = cudaStreamSynchronize(stream); sticky) return sticky;
      continue;
    }
    if (int(i) == r->heuristic_index)
      if (cudaError_t err = cudaMemcpyAsync(in.reference, x.o, in.out_elems * 2,
                                            cudaMemcpyDeviceToDevice, stream);
          err)
        return err;
    if (cudaError_t err =
            compare(p0.dtype, in.reference, x.o, in.out_elems, in.stats, own.host, stream);
        err)
      return err;
    float max_ref = 0, max_diff = 0;
    std::memcpy(&max_ref, &own.host[0], 4);
    std::memcpy(&max_diff, &own.host[1], 4);
    t.max_abs_diff = max_diff;
    const double tolerance = kToleranceUlps * eps * max_ref;
    if (own.host[2] != 0)
      t.error = std::to_string(own.host[2]) + " NaN/Inf (or unwritten) output elements";
    else if (max_diff > tolerance)
      t.error = "output differs from the heuristic's by " + std::to_string(max_diff);
    t.ok = t.error.empty();
  }
  return cudaSuccess;
}

/// Times the ok candidates, interleaved per repetition, over the rotated sets.
cudaError_t time_candidates(const Inputs& in, const TuneOptions& o, cudaStream_t stream,
                            DecodeTuneReport* r) {
  std::vector<int> live;
  for (size_t i = 0; i < r->timings.size(); ++i)
    if (r->timings[i].ok) live.push_back(int(i));
  size_t next = 0;
  auto launch = [&](int c) {
    DecodeParams x = in.sets[next++ % in.sets.size()];
    x.num_splits = r->timings[live[c]].num_splits;
    return run_decode(x, stream);
  };
  std::vector<double> medians;
  if (cudaError_t err = time_interleaved(int(live.size()), o.warmup, o.repetitions, stream, launch,
                                         &medians);
      err)
    return err;
  for (size_t c = 0; c < live.size(); ++c) r->timings[live[c]].median_ms = medians[c];
  for (int c : live)
    if (r->best < 0 || r->timings[c].median_ms < r->timings[r->best].median_ms) r->best = c;
  return cudaSuccess;
}

cudaError_t tune_decode_impl(const DecodeParams& problem, cudaStream_t stream, const TuneOptions& o,
                             DecodeTuneReport* r) {
  if (problem.block_table != nullptr && problem.page_size < 1) return cudaErrorInvalidValue;
  if (problem.batch < 1 || problem.seqlen_k < 1 || o.warmup < 0 || o.repetitions < 20)
    return cudaErrorInvalidValue;
  const DecodeParams p = tuner_problem(problem);
  DecodeParams check = p;
  alignas(16) static char dummy[16];
  check.q = check.k = check.v = check.o = dummy;
  if (p.page_size > 0) check.seqlens_k = check.block_table = reinterpret_cast<int32_t*>(dummy);
  if (!decode_supported(check).empty()) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  if (cudaError_t err = cudaGetDevice(&device); err) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); err)
    return err;
  r->heuristic = decode_num_splits(p, sms);
  const std::vector<int> counts = decode_split_candidates(p, sms);
  for (int s : counts) {
    if (s == r->heuristic) r->heuristic_index = int(r->timings.size());
    DecodeSplitTiming t;
    t.num_splits = s;
    r->timings.push_back(t);
  }
  if (r->heuristic_index < 0) return cudaErrorInvalidValue;  // candidates must include it
  Owned own;
  if (cudaMallocHost(&own.host, 4 * sizeof(unsigned int)) != cudaSuccess) {
    own.host = nullptr;
    return cudaErrorMemoryAllocation;
  }
  Inputs in;
  if (cudaError_t err = make_inputs(p, counts.back(), o, own, stream, &in); err) return err;
  if (cudaError_t err = check_candidates(in, own, stream, r); err) return err;
  if (!r->timings[r->heuristic_index].ok) return cudaErrorLaunchFailure;
  return time_candidates(in, o, stream, r);
}

}  // namespace

cudaError_t tune_decode_splits(const DecodeParams& problem, cudaStream_t stream,
                               const TuneOptions& options, DecodeTuneReport* report) {
  if (report == nullptr) return cudaErrorInvalidValue;
  *report = DecodeTuneReport{};
  try {
    const cudaError_t err = tune_decode_impl(problem, stream, options, report);
    if (err != cudaSuccess) report->best = -1;
    return err;
  } catch (const std::bad_alloc&) {
    report->best = -1;
    return cudaErrorMemoryAllocation;
  }
}

}  // namespace flashserve::kernels::cuda
