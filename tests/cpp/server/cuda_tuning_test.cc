// TuneDecodeClass on a real GPU (label "gpu": skips without one): a decode class records the
// heuristic's "splits=plan" unless its best count clearly beat the heuristic's on the class's
// representative (decode_class.h, DecodeTunedConfig).
#include "autotune/cuda_tuning.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>
#include <string>

#include "autotune/decode_class.h"
#include "cuda_test_util.h"
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

}  // namespace
}  // namespace flashserve
