// Autotuning on the CPU: class bucketing, the cache file (round trip, foreign/corrupt files,
// atomic writes) and the background tuner never blocking a lookup.
#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "autotune/background_tuner.h"
#include "autotune/problem_class.h"
#include "autotune/tune_cache.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using kernels::DType;

DeviceIdentity H100() { return {"NVIDIA H100 80GB HBM3", 9, 0}; }

TuneCacheHeader Header(std::string build = "abc123") {
  TuneCacheHeader h;
  h.device_name = "NVIDIA H100 80GB HBM3";
  h.cc_major = 9;
  h.cc_minor = 0;
  h.sm_count = 132;
  h.driver_version = 13000;
  h.runtime_version = 13000;
  h.build_id = std::move(build);
  return h;
}

std::string TempPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/", name, ".", getpid(), ".json");
}

// A cache of `header` refuses the file at `path` as another setup's, naming `why`, and loads
// nothing.
void ExpectRefusedAs(const TuneCacheHeader& header, const std::string& path,
                     const std::string& why) {
  TuneCache cache(header);
  const absl::Status s = cache.Load(path);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(why), std::string::npos) << s;
  EXPECT_EQ(cache.size(), 0u);
}

// Files named `path`.tmp.* in its directory.
int TempFilesOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash), prefix = path.substr(slash + 1) + ".tmp.";
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += std::string(e->d_name).rfind(prefix, 0) == 0 ? 1 : 0;
    closedir(d);
  }
  return n;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(ProblemClass, SeqlenBuckets) {
  EXPECT_EQ(SeqlenQBucket(1), 16);
  EXPECT_EQ(SeqlenQBucket(16), 16);  // decode-like class
  EXPECT_EQ(SeqlenQBucket(17), 32);
  EXPECT_EQ(SeqlenQBucket(1000), 1024);
  EXPECT_EQ(SeqlenQBucket(1024), 1024);
  EXPECT_EQ(SeqlenQBucket(1025), 2048);
  EXPECT_EQ(SeqlenQBucket(1 << 20), 1 << 17);  // top bucket
  EXPECT_EQ(SeqlenKBucket(1), 16);
  EXPECT_EQ(SeqlenKBucket(4099), 8192);
}

TEST(ProblemClass, GqaBuckets) {
  EXPECT_EQ(GqaBucket(16, 16), 1);
  EXPECT_EQ(GqaBucket(32, 16), 2);
  EXPECT_EQ(GqaBucket(24, 8), 4);  // ratio 3 rounds up
  EXPECT_EQ(GqaBucket(32, 8), 4);
  EXPECT_EQ(GqaBucket(64, 1), 16);
  EXPECT_EQ(GqaBucket(128, 1), 16);
}

TEST(ProblemClass, KeyAndClassOf) {
  auto p = kernels::make_contiguous_params(DType::kBFloat16, 2, 4000, 4000, 32, 8, 128, true, 0.1f);
  ProblemClass c = ClassOf(p, H100());
  EXPECT_EQ(c.key(), "sm90|bf16|d128|causal|gqa4|q4096|k4096");
  auto same_class =
      kernels::make_contiguous_params(DType::kBFloat16, 7, 3000, 2100, 64, 16, 128, true, 0.1f);
  EXPECT_EQ(ClassOf(same_class, H100()).key(), c.key());
  auto other = same_class;
  other.causal = false;
  EXPECT_NE(ClassOf(other, H100()).key(), c.key());
}

TEST(ProblemClass, RepresentativeBelongsToItsClass) {
  for (int sq : {1, 16, 100, 4096, 16384}) {
    for (int ratio : {1, 4, 16}) {
      auto p = kernels::make_contiguous_params(DType::kFloat16, 1, sq, 2 * sq + 5, 8 * ratio, 8, 64,
                                               false, 0.125f);
      ProblemClass c = ClassOf(p, H100());
      kernels::AttentionParams r = c.representative(132);
      EXPECT_EQ(ClassOf(r, H100()).key(), c.key()) << c.key();
      EXPECT_GE(r.batch, 1);
      // Enough work to fill 132 SMs at least once.
      EXPECT_GE(int64_t{r.batch} * r.heads_q * ((r.seqlen_q + 127) / 128), 132) << c.key();
    }
  }
}

// Classes too big to time beside live requests are left to the heuristic (or an offline tuning).
TEST(ProblemClass, OnlyClassesOfBoundedWorkAreTunedLive) {
  DeviceIdentity device{"H100", 9, 0};
  kernels::AttentionParams typical = kernels::make_contiguous_params(
      kernels::DType::kBFloat16, 4, 4096, 4096, 16, 16, 128, true, 0.088f);
  EXPECT_TRUE(ClassOf(typical, device).tunable_live(132));
  kernels::AttentionParams huge = kernels::make_contiguous_params(
      kernels::DType::kBFloat16, 1, 65537, 65537, 1, 1, 128, false, 0.088f);
  EXPECT_FALSE(ClassOf(huge, device).tunable_live(132));
}

TEST(TuneCache, RoundTrip) {
  TuneCache cache(Header());
  TuneRecord r{"m128n64w4s2", 351.5, "m128n128w8s2", 340.25, "m128n64w4s1", 300.0, 7};
  cache.Put("sm90|bf16|d128|full|gqa1|q4096|k4096", r);
  cache.Put("sm90|fp16|d64|causal|gqa1|q16|k1024",
            {"m64n64w4s2", 12.5, "", 0, "m64n64w4s2", 12.5, 1});
  const std::string path = TempPath("roundtrip");
  ASSERT_TRUE(cache.Save(path).ok());
  TuneCache loaded(Header());
  ASSERT_TRUE(loaded.Load(path).ok());
  EXPECT_EQ(loaded.size(), 2u);
  std::optional<TuneRecord> got = loaded.Find("sm90|bf16|d128|full|gqa1|q4096|k4096");
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->config, "m128n64w4s2");
  EXPECT_DOUBLE_EQ(got->tflops, 351.5);
  EXPECT_EQ(got->runner_up, "m128n128w8s2");
  EXPECT_DOUBLE_EQ(got->runner_up_tflops, 340.25);
  EXPECT_EQ(got->default_config, "m128n64w4s1");
  EXPECT_EQ(got->candidates_timed, 7);
  EXPECT_EQ(loaded.ToJson(), cache.ToJson());
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

TEST(TuneCache, MissingFileIsEmptyNotError) {
  TuneCache cache(Header());
  EXPECT_TRUE(cache.Load(TempPath("does-not-exist")).ok());
  EXPECT_EQ(cache.size(), 0u);
}

TEST(TuneCache, ForeignDeviceOrBuildIsIgnored) {
  TuneCache cache(Header());
  cache.Put("k", {"m128n64w4s2", 1, "", 0, "", 0, 1});
  const std::string path = TempPath("foreign");
  ASSERT_TRUE(cache.Save(path).ok());

  ExpectRefusedAs(Header("def456"), path, "kernel build abc123 != this build def456");
  TuneCacheHeader h200 = Header();
  h200.device_name = "NVIDIA H200";
  ExpectRefusedAs(h200, path, "NVIDIA H100");
  // A MIG slice reports its GPU's name and compute capability: the SM count tells them apart
  // (split-KV plans and grids were timed for the whole GPU).
  TuneCacheHeader mig_slice = Header();
  mig_slice.sm_count = 16;
  ExpectRefusedAs(mig_slice, path, "132 SMs != this device's 16");
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// Files written before the SM count was recorded are for an unknown SM count: not used.
TEST(TuneCache, AFileWithoutAnSmCountIsForAnotherSetup) {
  TuneCache cache(Header());
  cache.Put("k", {"m128n64w4s2", 1, "", 0, "", 0, 1});
  std::string text = cache.ToJson();
  const size_t at = text.find("\"sm_count\": 132");
  ASSERT_NE(at, std::string::npos) << text;
  text.replace(at, 9, "\"sm_count_unknown");  // the field is gone (an unknown one is ignored)
  const std::string path = TempPath("no_sm_count");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  ExpectRefusedAs(Header(), path, "an unrecorded number of SMs");
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

TEST(TuneCache, CorruptOrTruncatedIsIgnored) {
  TuneCache cache(Header());
  cache.Put("k", {"m128n64w4s2", 1, "", 0, "", 0, 1});
  const std::string full = cache.ToJson();
  const std::string path = TempPath("corrupt");
  // Every truncation of a valid file, plus garbage and wrong types: never a crash, never entries.
  std::vector<std::string> bad;
  for (size_t n = 0; n + 1 < full.size(); n += 7) bad.push_back(full.substr(0, n));
  bad.push_back("\x00\xff garbage");
  bad.push_back("[]");
  bad.push_back(R"({"format":"flashserve-tune-cache/1","device":{"name":5}})");
  bad.push_back(R"({"format":"flashserve-tune-cache/1","device":{"name":"NVIDIA H100 80GB HBM3",)"
                R"("cc_major":9,"cc_minor":0,"sm_count":132,"driver_version":13000,)"
                R"("runtime_version":13000},"build_id":"abc123","entries":[]})");
  std::string huge_int = full;  // a float where an int belongs (was undefined behaviour; found by fuzzing)
  huge_int.replace(huge_int.find("\"cc_major\": 9"), 13, "\"cc_major\": 1e20");
  bad.push_back(huge_int);
  for (const std::string& text : bad) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
    TuneCache loaded(Header());
    absl::Status s = loaded.Load(path);
    EXPECT_FALSE(s.ok()) << "accepted: " << text.substr(0, 60);
    EXPECT_EQ(loaded.size(), 0u);
  }
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// One malformed entry (a hand edit, a field of another type) made the whole file unreadable, and
// the next save replaced it with this process's entries alone: every other class was lost.
TEST(TuneCache, AMalformedEntryIsSkippedAndTheOthersKept) {
  TuneCache cache(Header());
  for (int i = 0; i < 5; ++i)
    cache.Put(absl::StrCat("k", i), {"m128n64w4s2", 1.0 + i, "", 0, "", 0, 1});
  std::string text = cache.ToJson();
  const size_t k1 = text.find("\"k1\"");
  text.replace(text.find("\"tflops\": 2.0", k1), 13, "\"tflops\": \"x\"");  // k1: wrong type
  const size_t k3 = text.find("\"k3\"");
  text.replace(text.find("\"candidates_timed\": 1", k3), 21, "\"candidates_timed\": 1e20");
  const std::string path = TempPath("one_bad_entry");
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;

  TuneCache loaded(Header());
  TuneCache::LoadReport report;
  ASSERT_TRUE(loaded.Load(path, &report).ok()) << loaded.Load(path);
  EXPECT_EQ(loaded.size(), 3u);
  EXPECT_FALSE(loaded.Find("k1").has_value());
  EXPECT_FALSE(loaded.Find("k3").has_value());
  EXPECT_EQ(loaded.Find("k4")->tflops, 5.0);
  EXPECT_EQ(report.skipped, 2);
  EXPECT_NE(report.Warning(path).find("\"k1\""), std::string::npos) << report.Warning(path);
  EXPECT_EQ(TuneCache::LoadReport{}.Warning(path), "");

  // Another writer's save keeps the good entries and drops the bad ones.
  TuneCache writer(Header());
  writer.Put("mine", {"m64n64w4s2", 9, "", 0, "", 0, 1});
  ASSERT_TRUE(writer.Save(path).ok());
  TuneCache reread(Header());
  ASSERT_TRUE(reread.Load(path, &report).ok());
  EXPECT_EQ(reread.size(), 4u);
  EXPECT_EQ(report.skipped, 0);
  EXPECT_TRUE(reread.Find("k0").has_value());
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

TEST(TuneCache, SaveIsAtomicAndLeavesNoTemp) {
  const std::string path = TempPath("atomic");
  TuneCache first(Header());
  first.Put("a", {"m128n64w4s2", 1, "", 0, "", 0, 1});
  ASSERT_TRUE(first.Save(path).ok());
  const std::string before = ReadFile(path);
  // A save into an unwritable location fails cleanly and leaves the old file intact.
  TuneCache second(Header());
  second.Put("b", {"m64n64w4s2", 2, "", 0, "", 0, 1});
  EXPECT_FALSE(second.Save("/nonexistent-dir/cache.json").ok());
  EXPECT_EQ(ReadFile(path), before);
  // A successful save keeps what the file held (another writer's entries) and adds its own; no
  // temp file stays behind.
  ASSERT_TRUE(second.Save(path).ok());
  TuneCache reread(Header());
  ASSERT_TRUE(reread.Load(path).ok());
  EXPECT_TRUE(reread.Find("a").has_value());
  EXPECT_TRUE(reread.Find("b").has_value());
  EXPECT_EQ(TempFilesOf(path), 0);
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// Two writers of one file (a server tuning in the background and flashserve-tune, or replicas on a
// shared volume): each save wrote only its own entries, so the last one wiped the other's, and
// writers with the same pid (pid 1 in containers) shared one temp file.
TEST(TuneCache, WritersOfOneFileKeepEachOthersEntries) {
  const std::string path = TempPath("writers");
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w) {
    writers.emplace_back([&, w] {
      TuneCache mine(Header());
      for (int i = 0; i < 25; ++i) {
        mine.Put(absl::StrCat("w", w, "-", i), {"m128n64w4s2", double(i), "", 0, "", 0, 1});
        ASSERT_TRUE(mine.Save(path).ok());
      }
    });
  }
  for (std::thread& t : writers) t.join();
  TuneCache reread(Header());
  ASSERT_TRUE(reread.Load(path).ok());
  EXPECT_EQ(reread.size(), 50u);
  EXPECT_EQ(TempFilesOf(path), 0);
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// A writer that holds the lock and never lets go (a stopped flashserve-tune, a hung network file
// system) held Save -- the tuner thread, and a server's shutdown joining it -- forever.
TEST(TuneCache, ALockHeldByAnotherWriterSkipsTheSaveInTime) {
  const std::string path = TempPath("held_lock");
  const int other = ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(other, 0);
  ASSERT_EQ(::flock(other, LOCK_EX), 0);
  TuneCache cache(Header());
  cache.Put("k", {"m128n64w4s2", 1, "", 0, "", 0, 1});
  const absl::Time start = absl::Now();
  const absl::Status held = cache.Save(path, absl::Milliseconds(200));
  EXPECT_EQ(held.code(), absl::StatusCode::kUnavailable) << held;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  TuneCache none(Header());
  EXPECT_TRUE(none.Load(path).ok());
  EXPECT_EQ(none.size(), 0u) << "written without the lock";
  ::close(other);  // the other writer lets go: the next save goes through
  ASSERT_TRUE(cache.Save(path, absl::Milliseconds(200)).ok());
  TuneCache reread(Header());
  ASSERT_TRUE(reread.Load(path).ok());
  EXPECT_EQ(reread.size(), 1u);
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// A cache file is read whole into a JSON tree: a huge file, a device or a FIFO is refused unread
// (they exhausted memory or hung the start).
TEST(TuneCache, HugeOrSpecialFilesAreNotRead) {
  TuneCache cache(Header());
  EXPECT_EQ(cache.Load("/dev/zero").code(), absl::StatusCode::kFailedPrecondition);
  const std::string fifo = TempPath("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(cache.Load(fifo).code(), absl::StatusCode::kFailedPrecondition);
  std::remove(fifo.c_str());
  const std::string huge = TempPath("huge");
  {
    std::ofstream out(huge);
    out << "{";
  }
  ASSERT_EQ(truncate(huge.c_str(), TuneCache::kMaxFileBytes + 1), 0);  // sparse
  EXPECT_EQ(cache.Load(huge).code(), absl::StatusCode::kFailedPrecondition);
  std::remove(huge.c_str());
  EXPECT_EQ(cache.size(), 0u);
}

TEST(TuneCache, ConcurrentReadersDuringSaves) {
  const std::string path = TempPath("concurrent");
  TuneCache cache(Header());
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; i < 50; ++i) {
      cache.Put(absl::StrCat("k", i), {"m128n64w4s2", double(i), "", 0, "", 0, 1});
      ASSERT_TRUE(cache.Save(path).ok());
    }
    stop = true;
  });
  // Readers of the file always see a complete cache (rename is atomic).
  int reads = 0;
  while (!stop.load()) {
    TuneCache reader(Header());
    absl::Status s = reader.Load(path);
    EXPECT_TRUE(s.ok()) << s;
    ++reads;
  }
  writer.join();
  EXPECT_GT(reads, 0);
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

ProblemClass ClassWithSeqlen(int seqlen) {
  auto p = kernels::make_contiguous_params(DType::kBFloat16, 1, seqlen, seqlen, 16, 16, 128, false,
                                           0.1f);
  return ClassOf(p, H100());
}

TEST(BackgroundTuner, MissNeverWaitsForTuningAndLaterHits) {
  TuneCache cache(Header());
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> tuned{0};
  std::vector<std::string> events;
  absl::Mutex events_mu;
  BackgroundTuner tuner(
      &cache,
      [&](const ProblemClass& c) -> absl::StatusOr<TuneRecord> {
        gate.wait();  // tuning takes "forever" until released
        tuned++;
        return TuneRecord{"m128n64w8s2", 400, "m128n64w4s2", 380, "m128n64w4s2", 380, 2};
      },
      {},
      [&](const char* e) {
        absl::MutexLock lock(&events_mu);
        events.push_back(e);
      });
  const ProblemClass c = ClassWithSeqlen(4000);
  const absl::Time start = absl::Now();
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(tuner.Lookup(c).has_value());
  // None of them waited for the tuning (held until `release`): 100 waits of even 50 ms would
  // take 5 s; the bound leaves a loaded machine room.
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  release.set_value();
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(tuned.load(), 1);  // queued once despite 100 misses
  EXPECT_EQ(tuner.Lookup(c).value_or(""), "m128n64w8s2");
  absl::MutexLock lock(&events_mu);
  EXPECT_EQ(std::count(events.begin(), events.end(), std::string("miss")), 100);
  EXPECT_EQ(std::count(events.begin(), events.end(), std::string("tuned")), 1);
  EXPECT_EQ(std::count(events.begin(), events.end(), std::string("hit")), 1);
}

TEST(BackgroundTuner, TunesOneClassAtATimeAndSaves) {
  const std::string path = TempPath("bg");
  TuneCache cache(Header());
  std::atomic<int> running{0}, max_running{0};
  BackgroundTuner tuner(&cache,
                        [&](const ProblemClass& c) -> absl::StatusOr<TuneRecord> {
                          int now = ++running;
                          max_running = std::max(max_running.load(), now);
                          std::this_thread::sleep_for(std::chrono::milliseconds(5));
                          --running;
                          if (c.seqlen_q_bucket == 64)
                            return absl::InternalError("all candidates failed");
                          return TuneRecord{
                              absl::StrCat("cfg", c.seqlen_q_bucket), 1, "", 0, "", 0, 1};
                        },
                        {path});
  for (int s : {100, 300, 60, 1000, 5000}) tuner.Lookup(ClassWithSeqlen(s));
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(max_running.load(), 1);
  EXPECT_EQ(cache.size(), 4u);  // the failing class is not cached...
  EXPECT_FALSE(tuner.Lookup(ClassWithSeqlen(60)).has_value());
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));  // ...and not retried forever
  TuneCache reloaded(Header());
  ASSERT_TRUE(reloaded.Load(path).ok());
  EXPECT_EQ(reloaded.Find(ClassWithSeqlen(300).key())->config, "cfg512");
  std::remove(path.c_str());
  std::remove((path + ".lock").c_str());
}

// A tuner that fails `failures` times per key, then returns a record.
BackgroundTuner::JobFn FlakyJob(std::atomic<int>* runs, int failures) {
  return [runs, failures]() -> absl::StatusOr<TuneRecord> {
    if (++*runs <= failures) return absl::ResourceExhaustedError("no device memory for timing");
    return TuneRecord{"splits=4", 1, "", 0, "", 0, 1};
  };
}

// Decode classes are keyed by client-chosen heads and shapes: every new one was queued, tuned on
// the GPU and stored, without bound (and a cache file past 8 MiB is not read at the next start).
TEST(BackgroundTuner, HoldsAtMostMaxClasses) {
  TuneCache cache(Header());
  cache.Put("loaded", {"splits=2", 1, "", 0, "", 0, 1});
  std::vector<std::string> events;
  absl::Mutex events_mu;
  BackgroundTuner::Options options;
  options.max_classes = 4;  // one loaded + 3 new
  std::atomic<int> runs{0};
  BackgroundTuner tuner(
      &cache, [](const ProblemClass&) -> absl::StatusOr<TuneRecord> { return TuneRecord{}; },
      options,
      [&](const char* e) {
        absl::MutexLock lock(&events_mu);
        events.push_back(e);
      });
  for (int i = 0; i < 10; ++i) {
    EXPECT_FALSE(tuner.Lookup(absl::StrCat("decode|", i), FlakyJob(&runs, 0)).has_value());
    ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  }
  EXPECT_EQ(runs.load(), 3);
  EXPECT_EQ(cache.size(), 4u);
  EXPECT_EQ(tuner.Lookup("decode|2", FlakyJob(&runs, 0)).value_or(""), "splits=4");
  absl::MutexLock lock(&events_mu);
  EXPECT_EQ(std::count(events.begin(), events.end(), std::string("skipped")), 7);
}

// A class whose timing failed once (no device memory while requests held it) was never tuned
// again in the process; now a miss queues it again after retry_failed_after, at most
// max_failures times, and the failed classes count against max_classes.
TEST(BackgroundTuner, RetriesAFailedClassAfterAWhileAndGivesUp) {
  TuneCache cache(Header());
  BackgroundTuner::Options options;
  options.retry_failed_after = absl::Milliseconds(200);
  options.max_failures = 3;
  BackgroundTuner tuner(
      &cache, [](const ProblemClass&) -> absl::StatusOr<TuneRecord> { return TuneRecord{}; },
      options);
  std::atomic<int> flaky{0}, broken{0};
  auto miss_and_wait = [&](const std::string& key, std::atomic<int>* runs, int failures) {
    tuner.Lookup(key, FlakyJob(runs, failures));
    EXPECT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  };
  miss_and_wait("flaky", &flaky, 1);
  miss_and_wait("flaky", &flaky, 1);  // within retry_failed_after: not queued
  EXPECT_EQ(flaky.load(), 1);
  absl::SleepFor(absl::Milliseconds(250));
  miss_and_wait("flaky", &flaky, 1);
  EXPECT_EQ(flaky.load(), 2);
  EXPECT_EQ(tuner.Lookup("flaky", FlakyJob(&flaky, 1)).value_or(""), "splits=4");

  for (int i = 0; i < 6; ++i) {
    miss_and_wait("broken", &broken, 100);
    absl::SleepFor(absl::Milliseconds(250));
  }
  EXPECT_EQ(broken.load(), 3);  // given up after max_failures
}

// A failed class queued again is one class against max_classes, not two (it is in the queue and
// among the failed ones until it runs).
TEST(BackgroundTuner, AFailedClassQueuedAgainCountsOnceAgainstMaxClasses) {
  TuneCache cache(Header());
  BackgroundTuner::Options options;
  options.max_classes = 3;
  options.retry_failed_after = absl::Milliseconds(50);
  std::vector<std::string> events;
  absl::Mutex events_mu;
  BackgroundTuner tuner(
      &cache, [](const ProblemClass&) -> absl::StatusOr<TuneRecord> { return TuneRecord{}; },
      options,
      [&](const char* e) {
        absl::MutexLock lock(&events_mu);
        events.push_back(e);
      });
  std::atomic<int> flaky{0}, later{0};
  tuner.Lookup("flaky", FlakyJob(&flaky, 1));
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  absl::SleepFor(absl::Milliseconds(100));
  absl::Notification release;
  tuner.Lookup("blocker", [&release]() -> absl::StatusOr<TuneRecord> {
    release.WaitForNotification();
    return TuneRecord{"splits=1", 1, "", 0, "", 0, 1};
  });
  tuner.Lookup("flaky", FlakyJob(&flaky, 1));  // queued behind the blocker, still failed once
  tuner.Lookup("later", FlakyJob(&later, 0));  // blocker + flaky + later: 3 classes
  release.Notify();
  ASSERT_TRUE(tuner.WaitIdle(absl::Seconds(10)));
  EXPECT_EQ(flaky.load(), 2);
  EXPECT_EQ(later.load(), 1);
  EXPECT_EQ(cache.size(), 3u);
  absl::MutexLock lock(&events_mu);
  EXPECT_EQ(std::count(events.begin(), events.end(), std::string("skipped")), 0);
}

}  // namespace
}  // namespace flashserve
