// flashserve-tune: tunes a grid of problem classes on one GPU ahead of time and writes the
// cache the server reads with --tune_cache.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "autotune/cuda_tuning.h"
#include "autotune/tune_cache.h"
#include "autotune/tune_grid.h"

ABSL_FLAG(std::string, tune_cache, "flashserve-tune-cache.json",
          "Cache file to write (entries of a matching existing file are kept)");
ABSL_FLAG(int, device, 0, "CUDA device to tune on");
ABSL_FLAG(std::string, dtypes, "bf16,fp16", "Dtypes to tune: bf16, fp16");
ABSL_FLAG(std::string, head_dims, "64,128", "Head dims to tune");
ABSL_FLAG(std::string, causal, "both", "Causal variants: yes, no or both");
ABSL_FLAG(std::string, seqlens, "16,512,1024,2048,4096,8192,16384",
          "Sequence lengths: q (seqlen_q = seqlen_k) or q:k, comma-separated");
ABSL_FLAG(std::string, gqa, "1", "GQA ratios heads_q/heads_kv, comma-separated");
ABSL_FLAG(std::string, shapes_file, "",
          "Instead of the grid flags: one problem per line, \"dtype head_dim causal seqlen_q "
          "seqlen_k [gqa]\"");
ABSL_FLAG(int, repetitions, 20, "Timed launches per candidate (median taken; at least 20)");
ABSL_FLAG(bool, retune, false, "Tune classes already in the cache again");

namespace flashserve {
namespace {

int Main() {
  absl::StatusOr<TuneGrid> grid =
      absl::GetFlag(FLAGS_shapes_file).empty()
          ? ParseTuneGrid(absl::GetFlag(FLAGS_dtypes), absl::GetFlag(FLAGS_head_dims),
                          absl::GetFlag(FLAGS_causal), absl::GetFlag(FLAGS_seqlens),
                          absl::GetFlag(FLAGS_gqa))
          : ReadShapesFile(absl::GetFlag(FLAGS_shapes_file));
  if (!grid.ok()) {
    std::fprintf(stderr, "flashserve-tune: %s\n", std::string(grid.status().message()).c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_repetitions) < 20) {
    std::fprintf(stderr, "flashserve-tune: --repetitions must be >= 20\n");
    return 2;
  }
  const int device = absl::GetFlag(FLAGS_device);
  if (cudaSetDevice(device) != cudaSuccess) {
    std::fprintf(stderr, "flashserve-tune: cannot use CUDA device %d\n", device);
    return 1;
  }
  absl::StatusOr<DeviceIdentity> gpu = DescribeCudaDevice(device);
  if (!gpu.ok()) {
    std::fprintf(stderr, "flashserve-tune: %s\n", std::string(gpu.status().message()).c_str());
    return 1;
  }
  const std::string path = absl::GetFlag(FLAGS_tune_cache);
  TuneCache cache(CacheHeaderFor(*gpu));
  TuneCache::LoadReport report;
  if (absl::Status s = cache.Load(path, &report); !s.ok()) {
    std::fprintf(stderr, "flashserve-tune: warning: ignoring %s\n",
                 std::string(s.message()).c_str());
  } else if (report.skipped > 0) {
    std::fprintf(stderr, "flashserve-tune: warning: %s\n", report.Warning(path).c_str());
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  kernels::cuda::TuneOptions options;
  options.repetitions = absl::GetFlag(FLAGS_repetitions);

  const std::vector<ProblemClass> classes = GridClasses(*grid, *gpu);
  std::printf("flashserve-tune: %zu classes on %s (sm_%d%d, %d SMs) -> %s\n", classes.size(),
              gpu->name.c_str(), gpu->cc_major, gpu->cc_minor, gpu->sm_count, path.c_str());
  const absl::Time start = absl::Now();
  int failures = 0;
  for (size_t i = 0; i < classes.size(); ++i) {
    const ProblemClass& c = classes[i];
    if (!absl::GetFlag(FLAGS_retune) && cache.Find(c.key())) {
      std::printf("[%zu/%zu] %-40s cached\n", i + 1, classes.size(), c.key().c_str());
      continue;
    }
    const absl::Time t0 = absl::Now();
    absl::StatusOr<TuneRecord> record = TuneProblemClass(c, gpu->sm_count, stream, options);
    if (!record.ok()) {
      ++failures;
      std::printf("[%zu/%zu] %-40s FAILED: %s\n", i + 1, classes.size(), c.key().c_str(),
                  std::string(record.status().message()).c_str());
      continue;
    }
    cache.Put(c.key(), *record);
    const double speedup = record->default_tflops > 0 ? record->tflops / record->default_tflops : 0;
    std::printf("[%zu/%zu] %-40s %-14s %7.1f TFLOPS  %.3fx default (%s)  runner-up %s  %.1f s\n",
                i + 1, classes.size(), c.key().c_str(), record->config.c_str(), record->tflops,
                speedup, record->default_config.c_str(), record->runner_up.c_str(),
                absl::ToDoubleSeconds(absl::Now() - t0));
    std::fflush(stdout);
    if (absl::Status s = cache.Save(path); !s.ok()) {
      std::fprintf(stderr, "flashserve-tune: cannot write %s: %s\n", path.c_str(),
                   std::string(s.message()).c_str());
      return 1;
    }
  }
  cudaStreamDestroy(stream);
  std::printf("flashserve-tune: %zu classes in %.1f s, %d failed; cache has %zu entries\n",
              classes.size(), absl::ToDoubleSeconds(absl::Now() - start), failures, cache.size());
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace flashserve

int main(int argc, char** argv) {
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "tools/tune_main.cc");
  };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(
      "tunes the CUDA attention kernels for a grid of problem classes on one GPU and writes the "
      "cache for flashserve --tune_cache.\nUsage: flashserve-tune [--flag=value ...]");
  absl::ParseCommandLine(argc, argv);
  return flashserve::Main();
}
