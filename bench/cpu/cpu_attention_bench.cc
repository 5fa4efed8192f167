// CPU attention forward throughput. GFLOP/s counts 4 * B * H * Sq * Sk * d (halved for causal
// Sq == Sk, attention_flops). "per_core" divides by the threads used.
//   cpu_attention_bench --benchmark_repetitions=7 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/cpu/tile_kernel.h"  // Isa: compare the instruction sets on one machine
#include "flashserve/kernels/cpu_attention.h"
#include "flashserve/kernels/float_convert.h"

namespace {

using flashserve::kernels::AttentionParams;
using flashserve::kernels::DType;
namespace cpu = flashserve::kernels::cpu;

// Args: dtype, head_dim, threads, isa (0 best, 1 scalar, 2 avx2, 3 avx512), causal, seqlen, heads.
void Forward(benchmark::State& state) {
  const auto dtype = static_cast<DType>(state.range(0));
  const int head_dim = static_cast<int>(state.range(1));
  const int threads = static_cast<int>(state.range(2));
  const int isa_arg = static_cast<int>(state.range(3));
  const bool causal = state.range(4) != 0;
  const int seqlen = static_cast<int>(state.range(5));
  const int heads = static_cast<int>(state.range(6));
  const cpu::Isa isa = isa_arg == 1   ? cpu::Isa::kScalar
                       : isa_arg == 2 ? cpu::Isa::kAvx2
                       : isa_arg == 3 ? cpu::Isa::kAvx512
                                      : cpu::best_isa();
  if (!cpu::isa_available(isa)) {
    state.SkipWithError("instruction set not available on this CPU");
    return;
  }
  AttentionParams p = flashserve::kernels::make_contiguous_params(
      dtype, 1, seqlen, seqlen, heads, heads, head_dim, causal, 1.f / std::sqrt(float(head_dim)));
  const size_t elements = size_t(seqlen) * heads * head_dim;
  const size_t bytes = elements * flashserve::kernels::dtype_size(dtype);
  std::vector<char> q(bytes), k(bytes), v(bytes), o(bytes);
  std::vector<float> lse(size_t(heads) * seqlen);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < elements; ++i) {
    flashserve::kernels::store_element(q.data(), int64_t(i), dtype, normal(rng));
    flashserve::kernels::store_element(k.data(), int64_t(i), dtype, normal(rng));
    flashserve::kernels::store_element(v.data(), int64_t(i), dtype, normal(rng));
  }
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o.data();
  p.lse = lse.data();
  cpu::ThreadPool pool(threads);
  for (auto _ : state) {
    cpu::attention_forward_isa(p, &pool, isa);
    benchmark::DoNotOptimize(o.data());
    benchmark::ClobberMemory();
  }
  const double flops = flashserve::kernels::attention_flops(p);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["per_core"] =
      benchmark::Counter(flops / 1e9 / threads, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string(flashserve::kernels::dtype_name(dtype)) + " d" +
                 std::to_string(head_dim) + " " + cpu::isa_name(isa) + " threads " +
                 std::to_string(threads) + (causal ? " causal" : ""));
}

// Best repetition: on a shared machine the fastest run is the least disturbed one. Applied to
// every column, so the "max" row holds the highest GFLOP/s (and the longest time).
double max_of(const std::vector<double>& values) {
  return *std::max_element(values.begin(), values.end());
}

// The table: S = 1024, d = 64/128, fp32 and bf16, 1 thread (per core) and 2 (total).
BENCHMARK(Forward)
    ->ArgNames({"dtype", "d", "threads", "isa", "causal", "S", "H"})
    ->ArgsProduct(
        {{int(DType::kFloat32), int(DType::kBFloat16)}, {64, 128}, {1, 2}, {0}, {0}, {1024}, {8}})
    ->ComputeStatistics("max", max_of)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Instruction-set comparison (one thread, d = 128) and fp16, causal.
BENCHMARK(Forward)
    ->ArgNames({"dtype", "d", "threads", "isa", "causal", "S", "H"})
    ->ArgsProduct(
        {{int(DType::kFloat32), int(DType::kBFloat16)}, {128}, {1}, {1, 2, 3}, {0}, {1024}, {8}})
    ->Args({int(DType::kFloat16), 128, 1, 0, 0, 1024, 8})
    ->Args({int(DType::kBFloat16), 128, 2, 0, 1, 1024, 8})
    ->ComputeStatistics("max", max_of)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
