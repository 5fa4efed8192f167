// Forward-attention kernel benchmark: CUDA events, warm-up, median of >= 30 calls, inputs
// rotated over sets larger than twice the L2 cache. Times select()'s choice and, with --all,
// every candidate configuration. Prints a markdown table.
//   kernel_bench [--all] [--reps N] [--dtype bf16|fp16] [--d 64|128] [--causal 0|1]
//                [--b B --h H --hkv HKV --sq SQ --sk SK]   (default: the bench grid)
// An unknown flag, a missing value or one that is not a count is an error (usage, exit 2).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "flashserve/kernels/float_convert.h"

namespace {

using flashserve::kernels::AttentionParams;
using flashserve::kernels::DType;
namespace fk = flashserve::kernels::cuda;

#define CHECK_CUDA(expr)                                                               \
  do {                                                                                 \
    cudaError_t err_ = (expr);                                                         \
    if (err_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,              \
                   cudaGetErrorString(err_));                                          \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

struct Shape {
  DType dtype;
  int b, sq, sk, hq, hkv, d;
  bool causal;
};

// Fills a device buffer of n 16-bit values with N(0,1) samples (as fp16 or bf16 bits).
void fill_random(void* dev, size_t n, DType dtype, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> host(n);
  for (auto& x : host) {
    const float f = normal(rng);
    x = dtype == DType::kBFloat16 ? flashserve::kernels::float_to_bf16(f)
                                  : flashserve::kernels::float_to_half(f);
  }
  CHECK_CUDA(cudaMemcpy(dev, host.data(), n * 2, cudaMemcpyHostToDevice));
}

double time_config(const Shape& s, const fk::KernelConfig* cfg, std::vector<AttentionParams>& sets,
                   int reps) {
  auto launch = [&](AttentionParams& p) {
    CHECK_CUDA(cfg ? fk::run(p, *cfg, nullptr) : fk::run(p, nullptr));
  };
  for (int i = 0; i < 5; ++i) launch(sets[i % sets.size()]);
  std::vector<cudaEvent_t> ev(2 * reps);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[2 * i]));
    launch(sets[i % sets.size()]);
    CHECK_CUDA(cudaEventRecord(ev[2 * i + 1]));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) CHECK_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  (void)s;
  return ms[reps / 2] * 1e-3;
}

[[noreturn]] void Usage(const char* error) {
  std::fprintf(stderr,
               "error: %s\nusage: kernel_bench [--all] [--reps N] [--dtype bf16|fp16] [--d 64|128] "
               "[--causal 0|1]\n                    [--b B --h H --hkv HKV --sq SQ --sk SK]\n",
               error);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  bool all = false;
  int reps = 30;
  std::vector<Shape> shapes;
  Shape custom{DType::kBFloat16, 0, 0, 0, 0, 0, 128, false};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {  // the argument after a flag; a missing one is an error, not a default
      if (i + 1 >= argc) Usage(("missing value after " + a).c_str());
      return std::string(argv[++i]);
    };
    auto next = [&] {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 0 || n > (1L << 30)) {
        Usage((a + ": not a count: " + v).c_str());
      }
      return int(n);
    };
    if (a == "--all") all = true;
    else if (a == "--reps") reps = std::max(30, next());
    else if (a == "--dtype") {
      const std::string d = value();
      if (d != "bf16" && d != "fp16") Usage(("--dtype: bf16 or fp16, not " + d).c_str());
      custom.dtype = d == "fp16" ? DType::kFloat16 : DType::kBFloat16;
    } else if (a == "--d") custom.d = next();
    else if (a == "--causal") custom.causal = next() != 0;
    else if (a == "--b") custom.b = next();
    else if (a == "--h") custom.hq = next();
    else if (a == "--hkv") custom.hkv = next();
    else if (a == "--sq") custom.sq = next();
    else if (a == "--sk") custom.sk = next();
    else Usage(("unknown argument " + a).c_str());
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA GPU: skipping\n");
    return 0;
  }
  if (custom.b > 0) {
    if (custom.hkv == 0) custom.hkv = custom.hq;
    if (custom.sk == 0) custom.sk = custom.sq;
    shapes.push_back(custom);
  } else {
    for (int d : {64, 128})
      for (bool causal : {false, true})
        for (int s : {512, 1024, 2048, 4096, 8192, 16384}) {
          const int h = d == 128 ? 16 : 32;
          const int b = s <= 4096 ? 16 : (s == 8192 ? 8 : 4);
          shapes.push_back({DType::kBFloat16, b, s, s, h, h, d, causal});
        }
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("# kernel_bench on %s (%d SMs, L2 %d MiB), median of %d\n\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20, reps);
  std::printf("| dtype | d | causal | B | Hq:Hkv | Sq | Sk | config | ms | TFLOPS |\n|---|---|---|---|---|---|---|---|---|---|\n");
  std::mt19937 rng(std::random_device{}());
  for (const Shape& s : shapes) {
    const size_t q_elems = size_t(s.b) * s.sq * s.hq * s.d, kv_elems = size_t(s.b) * s.sk * s.hkv * s.d;
    const size_t set_bytes = (2 * q_elems + 2 * kv_elems) * 2;
    const size_t nsets = std::max<size_t>(2, (2 * size_t(prop.l2CacheSize) + set_bytes - 1) / set_bytes);
    std::vector<void*> buffers;
    std::vector<AttentionParams> sets;
    for (size_t i = 0; i < nsets; ++i) {
      void *q, *k, *v, *o;
      CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
      CHECK_CUDA(cudaMalloc(&k, kv_elems * 2));
      CHECK_CUDA(cudaMalloc(&v, kv_elems * 2));
      CHECK_CUDA(cudaMalloc(&o, q_elems * 2));
      fill_random(q, q_elems, s.dtype, rng);
      fill_random(k, kv_elems, s.dtype, rng);
      fill_random(v, kv_elems, s.dtype, rng);
      buffers.insert(buffers.end(), {q, k, v, o});
      AttentionParams p = flashserve::kernels::make_contiguous_params(
          s.dtype, s.b, s.sq, s.sk, s.hq, s.hkv, s.d, s.causal, 1.f / std::sqrt(float(s.d)));
      p.q = q, p.k = k, p.v = v, p.o = o;
      sets.push_back(p);
    }
    const double flops = flashserve::kernels::attention_flops(sets[0]);
    std::vector<fk::KernelConfig> configs{fk::select(sets[0], prop.multiProcessorCount)};
    if (all)
      for (const auto& c : fk::candidates(s.dtype, s.d, s.causal))
        if (c != configs[0]) configs.push_back(c);
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const double t = time_config(s, &configs[ci], sets, reps);
      std::printf("| %s | %d | %s | %d | %d:%d | %d | %d | %s%s | %.3f | %.1f |\n",
                  s.dtype == DType::kBFloat16 ? "bf16" : "fp16", s.d, s.causal ? "yes" : "no", s.b,
                  s.hq, s.hkv, s.sq, s.sk, configs[ci].name().c_str(), ci == 0 ? " (select)" : "",
                  t * 1e3, flops / t / 1e12);
    }
    std::fflush(stdout);
    for (void* b : buffers) CHECK_CUDA(cudaFree(b));
  }
  return 0;
}
