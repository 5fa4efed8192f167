// Decode problem classes for the split-count autotuner (server/autotune/decode_class.h) and the
// background tuner's keyed jobs that tune them; CPU only.
#include "autotune/decode_class.h"

#include <atomic>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "autotune/background_tuner.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using kernels::DType;

DeviceIdentity H100() { return {"NVIDIA H100 80GB HBM3", 9, 0}; }

DecodeShape Llama(int batch, int seqlen_q, int seqlen_k, int page_size) {
  DecodeShape s;
  s.dtype = DType::kBFloat16;
  s.head_dim = 128;
  s.heads_q = 32;
  s.heads_kv = 8;
  s.batch = batch;
  s.seqlen_q = seqlen_q;
  s.seqlen_k = seqlen_k;
  s.page_size = page_size;
  return s;
}

std::string KeyOf(const DecodeShape& s) {
  const std::optional<DecodeClass> c = DecodeClassOf(s, H100());
  return c ? c->key() : "none";
}

TEST(DecodeClass, KeyNamesEveryField) {
  EXPECT_EQ(KeyOf(Llama(64, 1, 8192, 64)), "decode|sm90|bf16|d128|full|kv8|g4|q1|b64|k8192|p64");
  DecodeShape s = Llama(1, 3, 131072, 0);
  s.causal = true;
  s.dtype = DType::kFloat16;
  EXPECT_EQ(KeyOf(s), "decode|sm90|fp16|d128|causal|kv8|g4|q4|b1|k131072|p0");
}

TEST(DecodeClass, PowerOfTwoBuckets) {
  EXPECT_EQ(KeyOf(Llama(33, 1, 8192, 64)), KeyOf(Llama(64, 1, 8192, 64)));
  EXPECT_NE(KeyOf(Llama(65, 1, 8192, 64)), KeyOf(Llama(64, 1, 8192, 64)));
  EXPECT_EQ(KeyOf(Llama(64, 1, 4097, 64)), KeyOf(Llama(64, 1, 8192, 64)));
  EXPECT_NE(KeyOf(Llama(64, 1, 8193, 64)), KeyOf(Llama(64, 1, 8192, 64)));
  EXPECT_EQ(KeyOf(Llama(64, 9, 8192, 64)), KeyOf(Llama(64, 16, 8192, 64)));
  EXPECT_EQ(KeyOf(Llama(64, 1, 8192, 48)), KeyOf(Llama(64, 1, 8192, 64)));  // page 48 -> 64
  const DecodeClass tiny = *DecodeClassOf(Llama(1, 1, 1, 1000), H100());
  EXPECT_EQ(tiny.seqlen_k_bucket, 64);  // at least one key tile
  EXPECT_EQ(tiny.page_bucket, 256);     // capped
  EXPECT_EQ(DecodeClassOf(Llama(5000, 1, 3 << 20, 16), H100())->batch_bucket, 1024);
  EXPECT_EQ(DecodeClassOf(Llama(5000, 1, 3 << 20, 16), H100())->seqlen_k_bucket, 1 << 20);
}

TEST(DecodeClass, LayoutAndModelAreExact) {
  EXPECT_NE(KeyOf(Llama(8, 1, 8192, 0)), KeyOf(Llama(8, 1, 8192, 64)));  // dense vs paged
  DecodeShape mha = Llama(8, 1, 8192, 64);
  mha.heads_kv = 32;
  EXPECT_NE(KeyOf(mha), KeyOf(Llama(8, 1, 8192, 64)));
  DecodeShape d64 = Llama(8, 1, 8192, 64);
  d64.head_dim = 64;
  EXPECT_NE(KeyOf(d64), KeyOf(Llama(8, 1, 8192, 64)));
}

TEST(DecodeClass, RejectsWhatTheClassesDoNotCover) {
  EXPECT_FALSE(DecodeClassOf(Llama(8, 17, 8192, 64), H100()));  // prefill-sized Sq
  EXPECT_FALSE(DecodeClassOf(Llama(0, 1, 8192, 64), H100()));
  EXPECT_FALSE(DecodeClassOf(Llama(8, 0, 8192, 64), H100()));
  EXPECT_FALSE(DecodeClassOf(Llama(8, 1, 0, 64), H100()));
  EXPECT_FALSE(DecodeClassOf(Llama(8, 1, 8192, -1), H100()));
  DecodeShape odd = Llama(8, 1, 8192, 64);
  odd.heads_q = 30;  // not a multiple of 8 KV heads
  EXPECT_FALSE(DecodeClassOf(odd, H100()));
  odd.heads_q = 4;  // fewer query than KV heads
  EXPECT_FALSE(DecodeClassOf(odd, H100()));
}

TEST(DecodeClass, RepresentativeIsTheBucketTopUnderTheMemoryCap) {
  for (const DecodeShape& s : {Llama(33, 3, 5000, 48), Llama(1, 1, 100000, 0), Llama(64, 1, 8192, 64)}) {
    const DecodeClass c = *DecodeClassOf(s, H100());
    const DecodeShape r = c.representative();
    EXPECT_EQ(KeyOf(r), c.key());  // these are under the 2 GiB cap
    EXPECT_GE(r.batch, s.batch);
    EXPECT_GE(r.seqlen_k, s.seqlen_k);
  }
  // 1024 x 1M keys x 4 KiB would be 4 TiB: seqlen_k shrinks until K/V fit in 2 GiB.
  const DecodeShape big = DecodeClassOf(Llama(1000, 1, 1 << 20, 64), H100())->representative();
  EXPECT_EQ(big.batch, 1024);     // the blocks per wave are kept
  EXPECT_EQ(big.seqlen_k, 1024);  // the floor (1024 x 1024 keys x 4 KiB is still 4 GiB)
  const DecodeShape mid = DecodeClassOf(Llama(64, 1, 100000, 64), H100())->representative();
  EXPECT_EQ(mid.seqlen_k, 8192);  // 64 x 8192 x 4 KiB = 2 GiB, the cap
  EXPECT_LE(int64_t{mid.batch} * mid.seqlen_k * 2 * 8 * 128 * 2, int64_t{2} << 30);
}

TEST(DecodeClass, KeysNeverCollideWithAttentionClasses) {
  ProblemClass attention;
  attention.device = H100();
  EXPECT_NE(attention.key().rfind("decode|", 0), 0u);
  EXPECT_EQ(KeyOf(Llama(1, 1, 64, 0)).rfind("decode|", 0), 0u);
}

TEST(DecodeClass, SplitsConfigRoundTripAndRejects) {
  for (int n = 1; n <= 128; ++n) EXPECT_EQ(ParseDecodeSplitsConfig(DecodeSplitsConfig(n)), n);
  EXPECT_EQ(DecodeSplitsConfig(0), "splits=plan");
  EXPECT_EQ(ParseDecodeSplitsConfig("splits=plan"), 0);
  for (const char* bad :
       {"splits=0", "splits=129", "splits=", "splits=3x", "splits=-2", "split=3", "splits= 3",
        "m128n64w4s2", "", "splits=Plan", "splits=plan ", "splits=planned"}) {
    EXPECT_FALSE(ParseDecodeSplitsConfig(bad)) << bad;
  }
}

// A count tuned on the bucket's top batch serves every batch of the class; it is pinned only
// where it beat the heuristic's count there by more than kDecodePinMargin (3%).
TEST(DecodeClass, TunedConfigPinsOnlyAClearWin) {
  EXPECT_EQ(DecodeTunedConfig(4, 0.90, 1.00), "splits=4");      // 10% faster: pinned
  EXPECT_EQ(DecodeTunedConfig(2, 0.994, 1.00), "splits=plan");  // within noise (H200 B64 Sk16k)
  EXPECT_EQ(DecodeTunedConfig(2, 0.971, 1.00), "splits=plan");  // 2.9%: not clearly
  EXPECT_EQ(DecodeTunedConfig(2, 0.969, 1.00), "splits=2");
  EXPECT_EQ(DecodeTunedConfig(1, 1.00, 1.00), "splits=plan");  // the heuristic's own count won
  EXPECT_EQ(DecodeTunedConfig(3, 1.00, 0.0), "splits=3");      // the heuristic's count failed
}

TEST(DecodeClass, SplitsFromConfigFallsBackToTheLaunchsOwnPlan) {
  EXPECT_EQ(DecodeSplitsFromConfig(std::nullopt, 6), 6);  // not tuned (yet)
  EXPECT_EQ(DecodeSplitsFromConfig(std::string("splits=plan"), 6), 6);
  EXPECT_EQ(DecodeSplitsFromConfig(std::string("splits=plan"), 2), 2);  // another batch's plan
  EXPECT_EQ(DecodeSplitsFromConfig(std::string("splits=4"), 6), 4);     // pinned
  EXPECT_EQ(DecodeSplitsFromConfig(std::string("splits=x"), 6), 6);     // malformed
  EXPECT_EQ(DecodeSplitsFromConfig(std::string("splits=0"), 6), 6);
}

TEST(BackgroundTunerJobs, DecodeClassIsTunedOnceInTheBackgroundThenHits) {
  TuneCache cache(TuneCacheHeader{"NVIDIA H100 80GB HBM3", 9, 0, 13000, 13000, "abc"});
  std::atomic<int> attention_runs{0}, decode_runs{0};
  BackgroundTuner tuner(
      &cache,
      [&](const ProblemClass&) -> absl::StatusOr<TuneRecord> {
        ++attention_runs;
        TuneRecord r;
        r.config = "m128n64w4s2";
        return r;
      },
      {});
  const std::string key = DecodeClassOf(Llama(64, 1, 8192, 64), H100())->key();
  auto job = [&]() -> absl::StatusOr<TuneRecord> {
    ++decode_runs;
    TuneRecord r;
    r.config = DecodeSplitsConfig(4);
    r.tflops = 2.9;  // K/V TB/s
    return r;
  };
  EXPECT_FALSE(tuner.Lookup(key, job));  // a miss answers at once
  tuner.Lookup(key, job);                // again while queued or running: not queued twice
  ProblemClass attention;
  attention.device = H100();
  tuner.Lookup(attention);  // the other kind shares the queue and the cache
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(30)));
  EXPECT_EQ(decode_runs.load(), 1);  // queued once although looked up twice
  EXPECT_EQ(attention_runs.load(), 1);
  const std::optional<std::string> hit = tuner.Lookup(key, job);
  ASSERT_TRUE(hit);
  EXPECT_EQ(ParseDecodeSplitsConfig(*hit), 4);
  EXPECT_EQ(cache.Find(attention.key())->config, "m128n64w4s2");
  EXPECT_EQ(decode_runs.load(), 1);
}

TEST(BackgroundTunerJobs, FailedJobIsNotRetriedAndLeavesNoEntry) {
  TuneCache cache(TuneCacheHeader{"NVIDIA H100 80GB HBM3", 9, 0, 13000, 13000, "abc"});
  BackgroundTuner tuner(&cache, [](const ProblemClass&) -> absl::StatusOr<TuneRecord> {
    return absl::InternalError("unused");
  }, {});
  std::atomic<int> runs{0};
  auto failing = [&]() -> absl::StatusOr<TuneRecord> {
    ++runs;
    return absl::ResourceExhaustedError("no memory for the tuner's K/V");
  };
  const std::string key = DecodeClassOf(Llama(1, 1, 131072, 64), H100())->key();
  EXPECT_FALSE(tuner.Lookup(key, failing));
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(30)));
  EXPECT_FALSE(tuner.Lookup(key, failing));  // the caller keeps the heuristic
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(30)));
  EXPECT_EQ(runs.load(), 1);
  EXPECT_FALSE(cache.Find(key));
}

}  // namespace
}  // namespace flashserve
