// TuneDecodeClass on a real GPU (label "gpu": skips without one): a decode class records the
// heuristic's "splits=plan" unless its best count clearly beat the heuristic's on the class's
// representative (decode_class.h, DecodeTunedConfig). KernelChooser: a cached configuration the
// problem cannot run is not handed out.
#include "autotune/cuda_tuning.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "autotune/decode_class.h"
#include "autotune/kernel_choice.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"
#include "cuda_test_util.h"
#include "flashserve/kernels/cuda_attention.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using kernels::DType;

using cuda_testing::DecodeHeadDimCompiled;
using cuda_testing::GpuAvailable;

DecodeShape Shape(int head_dim, int heads_q, int heads_kv, int batch, int seqlen_k) {
  DecodeShape s;
  s.dtype = DType::kBFloat16;
  s.head_dim = head_dim;
  s.heads_q = heads_q;
  s.heads_kv = heads_kv;
  s.batch = batch;
  s.seqlen_q = 1;
  s.seqlen_k = seqlen_k;
  s.page_size = 64;
  return s;
}

// Buckets where session 29 (H200) measured the count tuned on the top batch running smaller
// batches slower than their own plan (B64 Sk8k, d64 MHA B16 Sk16k), and a long single sequence.
TEST(CudaTuning, DecodeClassPinsOnlyAClearWin) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const DeviceIdentity device{"test GPU", 9, 0};
  for (const DecodeShape& s :
       {Shape(128, 32, 8, 40, 8192), Shape(64, 32, 32, 10, 16384), Shape(128, 32, 8, 1, 100000)}) {
    if (!DecodeHeadDimCompiled(s.head_dim)) continue;
    const DecodeClass c = *DecodeClassOf(s, device);
    SCOPED_TRACE(c.key());
    absl::StatusOr<TuneRecord> record = TuneDecodeClass(c, stream);
    ASSERT_TRUE(record.ok()) << record.status();
    const std::optional<int> splits = ParseDecodeSplitsConfig(record->config);
    ASSERT_TRUE(splits) << record->config;
    ASSERT_GT(record->default_tflops, 0) << "the heuristic's count ran";
    if (*splits == 0) {
      EXPECT_EQ(record->tflops, record->default_tflops) << "splits=plan reports the heuristic's";
    } else {
      // Pinned: more than kDecodePinMargin faster than the heuristic's count (TB/s are K/V bytes
      // over the median time, so the times' ratio is the inverse of the throughputs').
      EXPECT_GT(record->tflops * (1 - kDecodePinMargin), record->default_tflops)
          << record->config << " vs " << record->default_config;
    }
    std::printf("%s: %s %.3f TB/s (heuristic %s %.3f TB/s; runner-up %s)\n", c.key().c_str(),
                record->config.c_str(), record->tflops, record->default_config.c_str(),
                record->default_tflops, record->runner_up.c_str());
  }
  cudaStreamDestroy(stream);
}

// ProblemClass has no varlen bit: a dense problem's winner (here the 64-row sm80 tile, compiled
// for every head dim, without a varlen kernel) reaches packed inputs of the same class, which
// run() refuses for it. Choose hands out select()'s configuration instead, and the winner still
// to the dense problem. Nothing is launched (the device is only described).
TEST(KernelChooser, CachedConfigTheProblemCannotRunFallsBackToSelect) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  absl::StatusOr<DeviceIdentity> device = DescribeCudaDevice(0);
  ASSERT_TRUE(device.ok()) << device.status();
  alignas(16) static const char kData[16] = {};
  static const int kCu[4] = {0, 3, 5, 9};  // never read: Choose and runnable() touch no memory
  kernels::AttentionParams dense =
      kernels::make_contiguous_params(kernels::cuda::supported_dtypes().front(), 3, 4, 4, 2, 2,
                                      kernels::cuda::supported_head_dims().front(), false, 0.1f);
  dense.q = dense.k = dense.v = kData;
  dense.o = const_cast<char*>(kData);
  kernels::AttentionParams packed = dense;
  packed.cu_seqlens_q = packed.cu_seqlens_k = kCu;
  packed.total_q = 9;
  const kernels::cuda::KernelConfig winner{64, 64, 4, 2, false};
  ASSERT_FALSE(kernels::cuda::runnable(packed, winner));
  ASSERT_EQ(ClassOf(packed, *device).key(), ClassOf(dense, *device).key());

  const std::string path = ::testing::TempDir() + "/chooser_varlen_cache.json";
  TuneCache cache(CacheHeaderFor(*device));
  TuneRecord record;
  record.config = winner.name();
  record.tflops = 1;
  cache.Put(ClassOf(dense, *device).key(), record);
  ASSERT_TRUE(cache.Save(path).ok());
  KernelChoiceOptions options;  // autotune "off": the cache read-only
  options.tune_cache_path = path;
  absl::StatusOr<std::unique_ptr<KernelChooser>> chooser = KernelChooser::Create(options, 0);
  std::remove(path.c_str());
  ASSERT_TRUE(chooser.ok()) << chooser.status();
  const int sms = device->sm_count;
  EXPECT_EQ((*chooser)->Choose(dense, sms, /*covered=*/true), winner);
  const kernels::cuda::KernelConfig chosen = (*chooser)->Choose(packed, sms, /*covered=*/true);
  EXPECT_EQ(chosen, kernels::cuda::select(packed, sms)) << chosen.name();
  EXPECT_TRUE(kernels::cuda::runnable(packed, chosen)) << chosen.name();
}

// A MIG slice keeps its GPU's name and compute capability: the cache header and Covers() carry
// the SM count too, so another device of the same name with other SMs keeps the heuristics.
TEST(KernelChooser, TheCacheBelongsToOneSmCount) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  absl::StatusOr<DeviceIdentity> device = DescribeCudaDevice(0);
  ASSERT_TRUE(device.ok()) << device.status();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(device->sm_count, sms);
  EXPECT_EQ(CacheHeaderFor(*device).sm_count, sms);
  KernelChoiceOptions options;  // autotune "off" with a cache: read-only
  options.tune_cache_path = ::testing::TempDir() + "/chooser_sm_count_cache.json";
  absl::StatusOr<std::unique_ptr<KernelChooser>> chooser = KernelChooser::Create(options, 0);
  ASSERT_TRUE(chooser.ok()) << chooser.status();
  EXPECT_TRUE((*chooser)->Covers(*device));
  DeviceIdentity slice = *device;
  slice.sm_count = sms / 2;
  EXPECT_FALSE((*chooser)->Covers(slice));
  DeviceIdentity renamed = *device;
  renamed.name += " MIG";
  EXPECT_FALSE((*chooser)->Covers(renamed));
}

}  // namespace
}  // namespace flashserve
