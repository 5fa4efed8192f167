// The KV cache with the CPU store: append-then-attend against the fp64 reference over many steps,
// all-or-nothing failures, pool exhaustion, TTL, release, limits and bad inputs.
#include "kvcache/sequence_cache.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kv_test_util.h"
#include "kvcache/sequence_id.h"
#include "runtime/cpu_kv_store.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::DenseLayer;
using testing::RandomRows;
using testing::Rows;

SequenceShape Shape(int layers, int hq, int hkv, int d, DType dtype) {
  SequenceShape s;
  s.num_layers = layers;
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.head_dim = d;
  s.dtype = dtype;
  return s;
}

class SequenceCacheTest : public ::testing::Test {
 protected:
  void Make(int64_t bytes, int page_tokens, absl::Duration ttl = absl::Seconds(300),
            int max_sequences = 64, int64_t max_tokens = 100000) {
    pool_ = std::make_unique<kernels::cpu::ThreadPool>(2);
    store_ = *CpuKvStore::Create(bytes, pool_.get());
    KvCacheOptions options;
    options.capacity_bytes = bytes;
    options.page_tokens = page_tokens;
    options.ttl = ttl;
    options.max_sequences = max_sequences;
    options.max_sequence_tokens = max_tokens;
    options.clock = [this] { return now_; };
    cache_ = *SequenceCache::Create(options, store_.get(), nullptr);
  }

  // A sequence of 40 tokens (3 pages of 16) held by a prepared step (*plan) until it is reset.
  std::string PinnedSequence(absl::StatusOr<StepPlan>* plan) {
    const SequenceShape s = Shape(1, 2, 1, 32, DType::kFloat16);
    std::vector<DenseLayer> dense;
    const std::string id = NewSequence(s, &dense, 40);
    pinned_q_ = RandomRows(&rng_, 1, 2, 32, DType::kFloat16);  // the plan's item reads it
    *plan = cache_->PrepareStep({StepItem{id, 0, Rows(pinned_q_, 2, 32, DType::kFloat16), {}, {}}});
    return id;
  }
  Bits pinned_q_;

  std::string NewSequence(const SequenceShape& s, std::vector<DenseLayer>* dense, int prefix) {
    CreateRequest request;
    request.shape = s;
    dense->assign(size_t(s.num_layers), {});
    std::vector<Bits> keep;
    keep.reserve(size_t(2 * s.num_layers));
    for (int l = 0; l < s.num_layers; ++l) {
      const int rows = prefix + l;  // layers of different lengths
      keep.push_back(RandomRows(&rng_, rows, s.heads_kv, s.head_dim, s.dtype));
      keep.push_back(RandomRows(&rng_, rows, s.heads_kv, s.head_dim, s.dtype));
      (*dense)[size_t(l)].Append(keep[keep.size() - 2], keep.back());
      request.prefix.push_back({l, Rows(keep[keep.size() - 2], s.heads_kv, s.head_dim, s.dtype),
                                Rows(keep.back(), s.heads_kv, s.head_dim, s.dtype)});
    }
    absl::StatusOr<SequenceStatus> created = cache_->CreateSequence(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id : "";
  }

  // One step over `ids` (layer each), appending `new_rows` random rows; checks every output.
  absl::Status Step(const SequenceShape& s, const std::vector<std::string>& ids,
                    const std::vector<int>& layers, std::vector<std::vector<DenseLayer>*> dense,
                    int new_rows, int rows_q, bool causal) {
    std::vector<Bits> qs, ks, vs;
    std::vector<StepItem> items;
    for (size_t i = 0; i < ids.size(); ++i) {
      qs.push_back(RandomRows(&rng_, rows_q, s.heads_q, s.head_dim, s.dtype));
      ks.push_back(RandomRows(&rng_, new_rows, s.heads_kv, s.head_dim, s.dtype));
      vs.push_back(RandomRows(&rng_, new_rows, s.heads_kv, s.head_dim, s.dtype));
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      items.push_back({ids[i], layers[i], Rows(qs[i], s.heads_q, s.head_dim, s.dtype),
                       Rows(ks[i], s.heads_kv, s.head_dim, s.dtype),
                       Rows(vs[i], s.heads_kv, s.head_dim, s.dtype)});
    }
    absl::StatusOr<StepPlan> plan = cache_->PrepareStep(items);
    if (!plan.ok()) return plan.status();
    const float scale = 1.f / std::sqrt(float(s.head_dim));
    plan->batch.causal = causal;
    plan->batch.softmax_scale = scale;
    std::vector<Bits> outs(ids.size(), Bits(qs[0].size(), 0x7e00));  // poisoned: NaN
    std::vector<std::vector<float>> lses(ids.size(),
                                         std::vector<float>(size_t(s.heads_q * rows_q), NAN));
    for (size_t i = 0; i < ids.size(); ++i) {
      plan->batch.items[i].out = outs[i].data();
      plan->batch.items[i].lse = lses[i].data();
    }
    AttendInfo kernel;
    if (absl::Status st = store_->Attend(plan->batch, &kernel); !st.ok()) return st;
    for (size_t i = 0; i < ids.size(); ++i) {
      DenseLayer& layer = (*dense[i])[size_t(layers[i])];
      layer.Append(ks[i], vs[i]);
      EXPECT_EQ(plan->batch.items[i].length,
                int64_t(layer.k.size()) / (int64_t(s.heads_kv) * s.head_dim));
      testing::CheckAgainstReference(s, layer, qs[i], rows_q, causal, scale, outs[i], lses[i],
                                     absl::StrCat("item ", i, " layer ", layers[i]));
    }
    return absl::OkStatus();
  }

  std::mt19937 rng_{20261124};
  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<CpuKvStore> store_;
  std::unique_ptr<SequenceCache> cache_;
};

TEST_F(SequenceCacheTest, AppendThenAttendMatchesFp64OverManySteps) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    Make(16 << 20, 7);                                  // odd page size: rows straddle pages
    const SequenceShape s = Shape(3, 6, 2, 40, dtype);  // GQA 3, odd head_dim
    std::vector<DenseLayer> a, b;
    const std::string id_a = NewSequence(s, &a, 5);
    const std::string id_b = NewSequence(s, &b, 0);  // starts empty
    for (int step = 0; step < 23; ++step) {
      const int layer = step % 3;
      ASSERT_TRUE(
          Step(s, {id_a, id_b}, {layer, (layer + 1) % 3}, {&a, &b}, step % 4 == 3 ? 0 : 1, 1, false)
              .ok());
    }
    // Speculative verification: 3 new rows, 3 query rows, causal bottom-right.
    ASSERT_TRUE(Step(s, {id_a, id_b}, {0, 2}, {&a, &b}, 3, 3, true).ok());
  }
}

// The CPU store keeps its pool in host memory: bytes on a GPU (a client's CUDA region) are refused
// with FAILED_PRECONDITION, never read; page-locked host bytes are served like any host bytes.
TEST_F(SequenceCacheTest, CpuStoreRefusesDeviceBytes) {
  Make(4 << 20, 16);
  const SequenceShape s = Shape(1, 4, 2, 64, DType::kFloat16);
  std::vector<DenseLayer> a;
  const std::string id = NewSequence(s, &a, 3);
  const Bits row = RandomRows(&rng_, 1, 2, 64, DType::kFloat16);
  const absl::Status write = store_->Write(0, row.data(), 256, BytesAt::kDevice);
  EXPECT_EQ(write.code(), absl::StatusCode::kFailedPrecondition) << write;
  EXPECT_NE(write.message().find("host memory"), std::string::npos) << write;
  EXPECT_TRUE(store_->Write(0, row.data(), 256, BytesAt::kPageLocked).ok());
  const Bits q = RandomRows(&rng_, 1, 4, 64, DType::kFloat16);
  const Bits none;
  const HostRows empty = Rows(none, 2, 64, DType::kFloat16);
  absl::StatusOr<StepPlan> plan =
      cache_->PrepareStep({{id, 0, Rows(q, 4, 64, DType::kFloat16), empty, empty}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  Bits out(q.size(), 0x7e00);
  plan->batch.softmax_scale = 0.125f;
  plan->batch.items[0].out = out.data();
  for (BytesAt* at : {&plan->batch.items[0].q_at, &plan->batch.items[0].out_at}) {
    *at = BytesAt::kDevice;
    AttendInfo info;
    const absl::Status attend = store_->Attend(plan->batch, &info);
    EXPECT_EQ(attend.code(), absl::StatusCode::kFailedPrecondition) << attend;
    *at = BytesAt::kHost;
  }
  EXPECT_EQ(out[0], 0x7e00);  // nothing written
}

TEST_F(SequenceCacheTest, EmptyLayerGivesZeroAndMinusInfinity) {
  Make(4 << 20, 16);
  const SequenceShape s = Shape(2, 4, 4, 64, DType::kFloat16);
  std::vector<DenseLayer> a;
  const std::string id = NewSequence(s, &a, 0);  // layer 0 empty, layer 1 one row
  ASSERT_TRUE(Step(s, {id}, {0}, {&a}, 0, 1, false).ok());
}

TEST_F(SequenceCacheTest, UnknownIdsAreAllNamedAndNothingChanges) {
  Make(4 << 20, 16);
  const SequenceShape s = Shape(1, 2, 1, 32, DType::kBFloat16);
  std::vector<DenseLayer> a;
  const std::string id = NewSequence(s, &a, 4);
  const std::string ghost1(32, 'a'), ghost2(32, '0');
  const absl::Status st = Step(s, {id, ghost1, ghost2}, {0, 0, 0}, {&a, &a, &a}, 1, 1, false);
  ASSERT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_EQ(MissingSequenceIdList(st), ghost1 + "," + ghost2);
  EXPECT_EQ(cache_->Info(id)->lengths[0], 4) << "a failed step appended rows";
}

// Ids of another shape than the server issues are unknown too, but client bytes of any length:
// never echoed raw (a newline in gRPC trailing metadata aborted the server), and not listed.
TEST_F(SequenceCacheTest, MalformedIdsAreNotFoundAndNeverEchoed) {
  Make(4 << 20, 16);
  const SequenceShape s = Shape(1, 2, 1, 32, DType::kBFloat16);
  std::vector<DenseLayer> a;
  const std::string id = NewSequence(s, &a, 4);
  EXPECT_TRUE(WellFormedSequenceId(id));
  const std::string ghost(32, 'b'), newline = "bad\nid", upper(32, 'A'), huge(1 << 20, 'c');
  for (const std::string& bad : {newline, upper, huge, std::string(31, 'a'), std::string()}) {
    EXPECT_FALSE(WellFormedSequenceId(bad)) << bad.size();
    const absl::Status info = cache_->Info(bad).status();
    ASSERT_EQ(info.code(), absl::StatusCode::kNotFound) << info;
    EXPECT_NE(info.message().find("a malformed id (" + std::to_string(bad.size()) + " bytes)"),
              std::string::npos)
        << info;
    EXPECT_EQ(MissingSequenceIdList(info), "");
    EXPECT_EQ(cache_->Append(bad, {}).status().code(), absl::StatusCode::kNotFound);
  }
  const absl::Status st =
      Step(s, {id, newline, ghost, huge}, {0, 0, 0, 0}, {&a, &a, &a, &a}, 1, 1, false);
  ASSERT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  EXPECT_EQ(MissingSequenceIdList(st), ghost);
  EXPECT_EQ(st.message().find('\n'), std::string::npos) << st;
  EXPECT_LT(st.message().size(), 4200u);
  EXPECT_EQ(cache_->Info(id)->lengths[0], 4) << "a failed step appended rows";
}

TEST_F(SequenceCacheTest, LongLabelsAreCutAtACharacterBoundary) {
  Make(4 << 20, 16);
  CreateRequest request;
  request.shape = Shape(1, 2, 1, 32, DType::kBFloat16);
  request.label = std::string(127, 'x') + "\xc3\xa9" + "tail";  // é straddles byte 128
  absl::StatusOr<SequenceStatus> created = cache_->CreateSequence(request);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(cache_->Info(created->id)->label, std::string(127, 'x'));
}

// A Release naming one live id twice listed it as "not found" (a client reads that as evicted);
// ids the server cannot have issued were copied and looked up under the cache's lock and returned
// (1,000 ids of 1 MiB held every other call for seconds). Now: released once, malformed skipped.
TEST_F(SequenceCacheTest, ReleaseCountsAnIdNamedTwiceOnceAndSkipsMalformedIds) {
  Make(4 << 20, 16);
  const SequenceShape s = Shape(1, 2, 1, 32, DType::kBFloat16);
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 4), id_b = NewSequence(s, &b, 4);
  const std::string ghost(32, 'e'), huge(1 << 20, 'c');
  int64_t released = -1;
  EXPECT_EQ(cache_->Release({id_a, huge, id_a, ghost, id_b, "x"}, &released),
            std::vector<std::string>{ghost});
  EXPECT_EQ(released, 2);
  EXPECT_EQ(cache_->Stats().used_bytes, 0);
  EXPECT_EQ(cache_->Release({id_a}, &released), std::vector<std::string>{id_a});
  EXPECT_EQ(released, 0);
}

TEST_F(SequenceCacheTest, PoolFullIsResourceExhaustedAllOrNothingAndReleaseFrees) {
  Make(2 << 20, 64);  // one slab: 2 MiB
  // row 2 heads x 128 x 2 B = 512 B; page = 64 tokens x 2 x 512 = 64 KiB: 32 pages in the pool
  const SequenceShape s = Shape(1, 2, 2, 128, DType::kFloat16);
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 64 * 20);  // 20 pages
  const std::string id_b = NewSequence(s, &b, 64 * 12);  // 12 pages: pool full
  EXPECT_EQ(cache_->Stats().pages_used, 32);
  const absl::Status st = Step(s, {id_a, id_b}, {0, 0}, {&a, &b}, 1, 1, false);
  ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("KV cache full"), std::string::npos) << st;
  EXPECT_EQ(cache_->Info(id_a)->lengths[0], 64 * 20) << "not all or nothing";
  EXPECT_EQ(cache_->Info(id_b)->lengths[0], 64 * 12);
  EXPECT_TRUE(cache_->Release({id_b}).empty());
  EXPECT_EQ(cache_->Stats().pages_used, 20);
  ASSERT_TRUE(Step(s, {id_a}, {0}, {&a}, 1, 1, false).ok());
  EXPECT_EQ(cache_->Release({id_b, id_a}), std::vector<std::string>{id_b});
  EXPECT_EQ(cache_->Stats().used_bytes, 0);
}

TEST_F(SequenceCacheTest, IdleSequencesAreEvictedAfterTheTtlAndPinnedOnesAreNot) {
  Make(4 << 20, 16, absl::Seconds(10));
  const SequenceShape s = Shape(1, 2, 1, 32, DType::kFloat16);
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 3);
  const std::string id_b = NewSequence(s, &b, 3);
  now_ += absl::Seconds(6);
  ASSERT_TRUE(Step(s, {id_b}, {0}, {&b}, 1, 1, false).ok());  // b used, a idle
  now_ += absl::Seconds(6);
  EXPECT_EQ(cache_->EvictIdle(), 1);
  EXPECT_EQ(cache_->Info(id_a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(cache_->Info(id_b).ok());
  EXPECT_EQ(cache_->Stats().evictions, 1);
  // A pinned (running) sequence is not evicted; idle counts from the step's end (a long launch is a
  // use: it was evicted right after one that outlasted the TTL), so once idle past it, it is.
  StepItem item{id_b, 0, {}, {}, {}};
  Bits q = RandomRows(&rng_, 1, 2, 32, DType::kFloat16);
  item.q = Rows(q, 2, 32, DType::kFloat16);
  absl::StatusOr<StepPlan> plan = cache_->PrepareStep({item});
  ASSERT_TRUE(plan.ok());
  now_ += absl::Seconds(60);
  EXPECT_EQ(cache_->EvictIdle(), 0);
  *plan = StepPlan();
  now_ += absl::Seconds(9);
  EXPECT_EQ(cache_->EvictIdle(), 0);  // (Info would count as a use too)
  now_ += absl::Seconds(2);
  EXPECT_EQ(cache_->EvictIdle(), 1);
  EXPECT_EQ(cache_->Stats().used_bytes, 0);
}

// An Append to a sequence idle past its TTL that no sweep has evicted yet (they run at most every
// TTL/8), on a full pool: making room for its pages must not evict the very sequence it appends
// to. It did, and the append then grew the freed sequence's page table (heap use-after-free).
TEST_F(SequenceCacheTest, AnAppendThatMakesRoomDoesNotEvictItsOwnSequence) {
  Make(2 << 20, 64, absl::Seconds(80));  // one slab; a sweep at most every 10 s
  const SequenceShape s = Shape(1, 2, 2, 128, DType::kFloat16);  // 64 KiB pages: 32 in the pool
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 64 * 20);  // 20 whole pages
  now_ += absl::Seconds(75);
  const std::string id_b = NewSequence(s, &b, 64 * 12);  // 12 pages: full; its sweep spared a
  now_ += absl::Seconds(6);                              // a idle for 81 s, the last sweep 6 s ago
  Bits k = RandomRows(&rng_, 1, 2, 128, DType::kFloat16);
  const HostRows row = Rows(k, 2, 128, DType::kFloat16);
  const absl::StatusOr<AppendResult> appended = cache_->Append(id_a, {{0, row, row}});
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kResourceExhausted) << appended.status();
  ASSERT_TRUE(cache_->Info(id_a).ok()) << "evicted while it was appended to";
  EXPECT_EQ(cache_->Info(id_a)->lengths[0], 64 * 20);
  EXPECT_TRUE(cache_->Info(id_b).ok());
}

// The same for a step: its sequences are pinned while room is made for its rows.
TEST_F(SequenceCacheTest, AStepThatMakesRoomDoesNotEvictItsOwnSequences) {
  Make(2 << 20, 64, absl::Seconds(80));
  const SequenceShape s = Shape(1, 2, 2, 128, DType::kFloat16);
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 64 * 20);
  now_ += absl::Seconds(75);
  const std::string id_b = NewSequence(s, &b, 64 * 12);
  now_ += absl::Seconds(6);
  const absl::Status st = Step(s, {id_a}, {0}, {&a}, 1, 1, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  ASSERT_TRUE(cache_->Info(id_a).ok()) << "evicted while a step used it";
  EXPECT_EQ(cache_->Info(id_a)->lengths[0], 64 * 20);
  EXPECT_TRUE(cache_->Info(id_b).ok());
}

// A layer that grows takes its next page in its last page's slab while that has room, though
// another slab is roomier: the decode kernel reads a layer within few 2 MiB slabs faster
// (page_allocator.h). Prefixes and steps alike pass the layer's last page to the allocator.
TEST_F(SequenceCacheTest, AGrowingLayerKeepsItsPagesInItsSlab) {
  Make(4 << 20, 64);  // two slabs of 32 pages (64 KiB)
  const SequenceShape s = Shape(1, 2, 2, 128, DType::kFloat16);
  std::vector<DenseLayer> a, filler, b;
  const std::string id_a = NewSequence(s, &a, 64 * 10);       // slab 0: pages 0-9
  const std::string id_f = NewSequence(s, &filler, 64 * 22);  // slab 0: 10-31
  const std::string id_b = NewSequence(s, &b, 64 * 4);        // slab 1: 0-3
  EXPECT_TRUE(cache_->Release({id_f}).empty());               // slab 0: 22 pages free, slab 1: 28
  Bits q = RandomRows(&rng_, 1, 2, 128, DType::kFloat16);
  Bits k = RandomRows(&rng_, 1, 2, 128, DType::kFloat16);
  const HostRows qr = Rows(q, 2, 128, DType::kFloat16), kr = Rows(k, 2, 128, DType::kFloat16);
  absl::StatusOr<StepPlan> plan =
      cache_->PrepareStep({{id_a, 0, qr, kr, kr}, {id_b, 0, qr, kr, kr}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<int32_t>& pages_a = plan->batch.items[0].pages;
  const std::vector<int32_t>& pages_b = plan->batch.items[1].pages;
  ASSERT_EQ(pages_a.size(), 11u);
  EXPECT_EQ(pages_a.back(), 10) << "a's 11th page left a's slab";
  ASSERT_EQ(pages_b.size(), 5u);
  EXPECT_EQ(pages_b.back(), 32 + 4) << "b's 5th page left b's slab";
  for (size_t i = 1; i < pages_a.size(); ++i) EXPECT_EQ(pages_a[i], pages_a[i - 1] + 1);
}

TEST_F(SequenceCacheTest, ReleaseWhileRunningFreesPagesWhenTheStepEnds) {
  Make(4 << 20, 16);
  absl::StatusOr<StepPlan> plan;
  const std::string id = PinnedSequence(&plan);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(cache_->Release({id}).empty());
  EXPECT_EQ(cache_->Info(id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->Stats().pages_used, 3) << "pages of a running step were freed";
  *plan = StepPlan();
  EXPECT_EQ(cache_->Stats().pages_used, 0);
}

// A Truncate waiting for a running step's pin ends CANCELLED, nothing cut, once its client has
// left (it used to wait for the step, or the deadline, on one of the few control threads).
TEST_F(SequenceCacheTest, ATruncateWaitingForAStepEndsWhenItsClientLeaves) {
  Make(4 << 20, 16);
  absl::StatusOr<StepPlan> plan;
  const std::string id = PinnedSequence(&plan);
  ASSERT_TRUE(plan.ok());
  std::atomic<bool> left{false};
  auto truncated = std::async(std::launch::async, [&] {
    return cache_->Truncate({{id, 8, {}}}, absl::InfiniteFuture(), [&] { return left.load(); })
        .status();
  });
  EXPECT_EQ(truncated.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "the Truncate did not wait for the step";
  left = true;
  ASSERT_EQ(truncated.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(truncated.get().code(), absl::StatusCode::kCancelled);
  *plan = StepPlan();
  EXPECT_EQ(cache_->Info(id)->lengths[0], 40) << "a cancelled Truncate cut";
}

TEST_F(SequenceCacheTest, MaxSequences) {
  Make(4 << 20, 16, absl::Seconds(300), 2);
  const SequenceShape s = Shape(1, 1, 1, 32, DType::kFloat16);
  std::vector<DenseLayer> a;
  NewSequence(s, &a, 0);
  NewSequence(s, &a, 0);
  CreateRequest request;
  request.shape = s;
  const absl::StatusOr<SequenceStatus> third = cache_->CreateSequence(request);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("--max_sequences"), std::string::npos);
}

TEST_F(SequenceCacheTest, BadInputsAreInvalidArgumentAndChangeNothing) {
  Make(4 << 20, 16, absl::Seconds(300), 64, 10);
  const SequenceShape s = Shape(2, 4, 2, 32, DType::kFloat16);
  std::vector<DenseLayer> a;
  const std::string id = NewSequence(s, &a, 8);  // layer 0: 8 rows, layer 1: 9 rows
  Bits q = RandomRows(&rng_, 1, 4, 32, DType::kFloat16);
  Bits kv = RandomRows(&rng_, 1, 2, 32, DType::kFloat16);
  Bits kv3 = RandomRows(&rng_, 3, 2, 32, DType::kFloat16);
  Bits q17 = RandomRows(&rng_, 17, 4, 32, DType::kFloat16);
  const HostRows good_q = Rows(q, 4, 32, DType::kFloat16);
  const HostRows good_kv = Rows(kv, 2, 32, DType::kFloat16);
  HostRows bf16_kv = good_kv;
  bf16_kv.dtype = DType::kBFloat16;
  const HostRows wrong_heads = Rows(q, 2, 64, DType::kFloat16);
  struct Case {
    const char* what;
    std::vector<StepItem> items;
    const char* message;
  } cases[] = {
      {"dtype switch", {{id, 0, good_q, bf16_kv, bf16_kv}}, "cannot change"},
      {"q heads", {{id, 0, Rows(kv, 2, 32, DType::kFloat16), good_kv, good_kv}}, "heads"},
      {"k head_dim", {{id, 0, good_q, wrong_heads, wrong_heads}}, "head_dim"},
      {"layer", {{id, 2, good_q, good_kv, good_kv}}, "out of range"},
      {"twice", {{id, 1, good_q, good_kv, good_kv}, {id, 1, good_q, good_kv, good_kv}}, "twice"},
      {"twice, named at the earliest repeat",
       {{id, 1, good_q, good_kv, good_kv},
        {id, 0, good_q, good_kv, good_kv},
        {id, 0, good_q, good_kv, good_kv},
        {id, 1, good_q, good_kv, good_kv}},
       "item 2: sequence"},
      {"past limit",
       {{id, 1, good_q, Rows(kv3, 2, 32, DType::kFloat16), Rows(kv3, 2, 32, DType::kFloat16)}},
       "limit"},
      {"q rows", {{id, 0, Rows(q17, 4, 32, DType::kFloat16), good_kv, good_kv}}, "rows"},
      {"k != v", {{id, 0, good_q, good_kv, Rows(kv3, 2, 32, DType::kFloat16)}}, "rows"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<StepPlan> plan = cache_->PrepareStep(c.items);
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(plan.status().message().find(c.message), std::string::npos)
        << c.what << ": " << plan.status();
  }
  EXPECT_EQ(cache_->Info(id)->lengths, (std::vector<int64_t>{8, 9}));
  CreateRequest bad;
  bad.shape = Shape(1, 3, 2, 32, DType::kFloat16);  // 3 % 2 != 0
  EXPECT_EQ(cache_->CreateSequence(bad).status().code(), absl::StatusCode::kInvalidArgument);
  bad.shape = Shape(1, 2, 2, 32, DType::kFloat32);
  EXPECT_EQ(cache_->CreateSequence(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Stats().sequences, 1);
}

TEST_F(SequenceCacheTest, ConcurrentStepsOnSharedAndDisjointSequences) {
  Make(32 << 20, 16);
  const SequenceShape s = Shape(2, 2, 1, 32, DType::kFloat16);
  std::vector<std::vector<DenseLayer>> dense(4);
  std::vector<std::string> ids;
  for (auto& d : dense) ids.push_back(NewSequence(s, &d, 2));
  std::atomic<int> failures{0};
  auto worker = [&](int t) {
    std::mt19937 rng{unsigned(t)};
    for (int i = 0; i < 200; ++i) {
      Bits q = RandomRows(&rng, 1, 2, 32, DType::kFloat16);
      Bits kv = RandomRows(&rng, 1, 1, 32, DType::kFloat16);
      // Thread t owns sequence t (layer 0); all share sequence 3 (layer 1).
      std::vector<StepItem> items = {
          {ids[size_t(t)], 0, Rows(q, 2, 32, DType::kFloat16), Rows(kv, 1, 32, DType::kFloat16),
           Rows(kv, 1, 32, DType::kFloat16)},
          {ids[3], 1, Rows(q, 2, 32, DType::kFloat16), Rows(kv, 1, 32, DType::kFloat16),
           Rows(kv, 1, 32, DType::kFloat16)}};
      absl::StatusOr<StepPlan> plan = cache_->PrepareStep(items);
      if (!plan.ok()) {
        ++failures;
        continue;
      }
      Bits out(q.size() * 2);
      plan->batch.softmax_scale = 0.2f;
      plan->batch.items[0].out = out.data();
      plan->batch.items[1].out = out.data() + q.size();
      AttendInfo kernel;
      if (!store_->Attend(plan->batch, &kernel).ok()) ++failures;
      if (i % 50 == 49 && t == 0) cache_->Release({ids[size_t(t)]});
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) threads.emplace_back(worker, t);
  for (auto& th : threads) th.join();
  // Thread 0 released its sequence after 50 steps: its later 150 steps are NOT_FOUND.
  EXPECT_EQ(failures.load(), 150);
  EXPECT_EQ(cache_->Info(ids[3])->lengths[1], 3 + 600 - 150);
  EXPECT_EQ(cache_->Info(ids[1])->lengths[0], 2 + 200);
}

// A decode call that waits to run (queued or batched) names sequences that were alive when it
// came: none of them is evicted by the TTL until it has left the wait -- it used to be, and the
// call was answered NOT_FOUND (the client then re-sent its prefix). A sequence already idle past
// the TTL when the oldest waiting call came still goes.
TEST_F(SequenceCacheTest, SequencesAliveWhenAWaitingCallCameAreNotEvictedUnderIt) {
  Make(4 << 20, 16, absl::Seconds(10));
  const SequenceShape s = Shape(1, 2, 1, 32, DType::kFloat16);
  std::vector<DenseLayer> a, b;
  const std::string id_a = NewSequence(s, &a, 3);  // used at t = 0
  now_ += absl::Seconds(5);
  const std::string id_b = NewSequence(s, &b, 3);  // used at t = 5
  now_ += absl::Seconds(7);                        // t = 12: a expired at t = 10
  const absl::Time waiting = cache_->CallWaiting();
  now_ += absl::Seconds(20);  // t = 32: both idle past the TTL, but b was alive at t = 12
  EXPECT_EQ(cache_->EvictIdle(), 1);
  EXPECT_EQ(cache_->Info(id_a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->Stats().sequences, 1);
  cache_->CallLeft(waiting);
  EXPECT_EQ(cache_->EvictIdle(), 1);
  EXPECT_EQ(cache_->Stats().sequences, 0);
  EXPECT_EQ(cache_->Stats().used_bytes, 0);
}

}  // namespace
}  // namespace flashserve::kvcache

namespace flashserve::kvcache {
namespace {

TEST(KvCacheMetrics, FollowThePool) {
  metrics::Registry registry;
  KvCacheMetrics metrics(&registry);
  kernels::cpu::ThreadPool pool(1);
  std::unique_ptr<CpuKvStore> store = *CpuKvStore::Create(4 << 20, &pool);
  KvCacheOptions options;
  options.capacity_bytes = 4 << 20;
  options.page_tokens = 16;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, store.get(), &metrics);
  CreateRequest request;
  request.shape = {1, 2, 2, 64, kernels::DType::kFloat16};  // page: 16 x 2 x 256 B = 8 KiB
  std::mt19937 rng(1);
  testing::Bits k = testing::RandomRows(&rng, 20, 2, 64, kernels::DType::kFloat16);
  request.prefix.push_back({0, testing::Rows(k, 2, 64, kernels::DType::kFloat16),
                            testing::Rows(k, 2, 64, kernels::DType::kFloat16)});
  const std::string id = cache->CreateSequence(request)->id;
  std::string text = registry.Render();
  EXPECT_NE(text.find("flashserve_kv_sequences 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flashserve_kv_pages_used 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flashserve_kv_pool_bytes{state=\"used\"} 16384\n"), std::string::npos);
  EXPECT_NE(text.find("flashserve_kv_pool_bytes{state=\"free\"} 4177920\n"), std::string::npos);
  EXPECT_TRUE(cache->Release({id}).empty());
  EXPECT_FALSE(cache->Append(id, {}).ok());
  text = registry.Render();
  EXPECT_NE(text.find("flashserve_kv_sequences 0\n"), std::string::npos);
  EXPECT_NE(text.find("flashserve_kv_sequences_released_total 1\n"), std::string::npos);
  EXPECT_NE(text.find("flashserve_kv_refusals_total{reason=\"not_found\"} 1\n"), std::string::npos);
}

}  // namespace
}  // namespace flashserve::kvcache

namespace flashserve::kvcache {
namespace {

// A store whose writes of `gated_bytes` or more wait until the test opens the gate.
class GatedStore final : public KvStore {
 public:
  explicit GatedStore(int64_t gated_bytes) : gated_bytes_(gated_bytes) {}
  std::string_view kind() const override { return "gated"; }
  int64_t capacity_bytes() const override { return 4 << 20; }
  absl::Status Write(int64_t, const void*, int64_t bytes, kvcache::BytesAt) override {
    if (bytes >= gated_bytes_) gate_.Wait();
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo* info) override {
    info->kernel = "gated";
    return absl::OkStatus();
  }
  void WaitUntilBlocked() { gate_.WaitUntilWaiting(); }
  void Open() { gate_.Open(); }

 private:
  const int64_t gated_bytes_;
  testing::Gate gate_;
};

TEST(SequenceCacheAppend, CopiesOutsideTheLockAndStepsOnTheSameSequenceWaitForIt) {
  GatedStore store(/*gated_bytes=*/4096);  // the 32-row append's pieces; a step's 1 row passes
  std::unique_ptr<SequenceCache> cache = testing::SmallCache(&store, 64);
  std::mt19937 rng(5);
  const kernels::DType f16 = kernels::DType::kFloat16;
  CreateRequest create;
  create.shape = {1, 1, 1, 64, f16};
  const std::string a = cache->CreateSequence(create)->id;
  const std::string b = cache->CreateSequence(create)->id;
  testing::Bits big = testing::RandomRows(&rng, 32, 1, 64, f16);  // 32 x 128 B = 4 KiB per tensor
  testing::Bits one = testing::RandomRows(&rng, 1, 1, 64, f16);
  auto appended = std::async(std::launch::async, [&] {
    return cache->Append(a, {{0, testing::Rows(big, 1, 64, f16), testing::Rows(big, 1, 64, f16)}});
  });
  store.WaitUntilBlocked();
  auto step = [&](const std::string& id) {
    return std::async(std::launch::async, [&cache, &one, id, f16] {
      StepItem item{id, 0, testing::Rows(one, 1, 64, f16), testing::Rows(one, 1, 64, f16),
                    testing::Rows(one, 1, 64, f16)};
      absl::StatusOr<StepPlan> plan = cache->PrepareStep({item});
      return plan.ok() ? plan->batch.items[0].length : int64_t(-1);
    });
  };
  auto other = step(b);  // another sequence: not held up by A's copy
  const bool free = other.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  if (!free) store.Open();  // let the threads finish before the futures are destroyed
  ASSERT_TRUE(free) << "a step on another sequence waited for an Append's copy (cache lock held)";
  EXPECT_EQ(other.get(), 1);
  auto same = step(a);  // the same sequence: waits, then sees the appended rows
  EXPECT_EQ(same.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  EXPECT_EQ(cache->Info(a)->lengths[0], 0) << "lengths moved before the rows were written";
  store.Open();
  ASSERT_TRUE(appended.get().ok());
  EXPECT_EQ(same.get(), 33);
}

// A cache over `store` (pages of 64 tokens) whose clock reads *now_s, in Unix seconds.
std::unique_ptr<SequenceCache> CacheWithClock(KvStore* store, std::atomic<int64_t>* now_s) {
  KvCacheOptions options;
  options.capacity_bytes = 4 << 20;
  options.page_tokens = 64;
  options.clock = [now_s] { return absl::FromUnixSeconds(now_s->load()); };
  return *SequenceCache::Create(options, store, nullptr);
}

// Sequence A (two layers) with a 32-row append to layer 0 held in its copy by the gate, and an
// Append and a step of one row to layer 1, deadline 1005 s, waiting behind it (clock at 1000 s).
class LateCallsBehindACopy : public ::testing::Test {
 protected:
  LateCallsBehindACopy() {
    const kernels::DType f16 = kernels::DType::kFloat16;
    CreateRequest create;
    create.shape = {2, 1, 1, 64, f16};
    a_ = cache_->CreateSequence(create)->id;
    appended_ = std::async(std::launch::async, [this, f16] {
      return cache_->Append(
          a_, {{0, testing::Rows(big_, 1, 64, f16), testing::Rows(big_, 1, 64, f16)}});
    });
    store_.WaitUntilBlocked();
    late_append_ = std::async(std::launch::async, [this] {
      return cache_->Append(a_, {{1, row_, row_}}, kDeadline).status();
    });
    late_step_ = std::async(std::launch::async, [this] {
      return cache_->PrepareStep({StepItem{a_, 1, row_, row_, row_}}, kDeadline).status();
    });
  }
  ~LateCallsBehindACopy() override { store_.Open(); }  // the futures then wait for their threads

  const absl::Time kDeadline = absl::FromUnixSeconds(1005);
  GatedStore store_{/*gated_bytes=*/4096};
  std::atomic<int64_t> now_s_{1000};
  std::unique_ptr<SequenceCache> cache_ = CacheWithClock(&store_, &now_s_);
  std::mt19937 rng_{7};
  testing::Bits big_ = testing::RandomRows(&rng_, 32, 1, 64, kernels::DType::kFloat16);
  testing::Bits one_ = testing::RandomRows(&rng_, 1, 1, 64, kernels::DType::kFloat16);
  HostRows row_ = testing::Rows(one_, 1, 64, kernels::DType::kFloat16);
  std::string a_;
  std::future<absl::StatusOr<AppendResult>> appended_;
  std::future<absl::Status> late_append_, late_step_;
};

// A call that waited for another append to its sequence past its deadline appends nothing: its
// client saw DEADLINE_EXCEEDED and moved on (before, the rows landed later, never acknowledged).
TEST_F(LateCallsBehindACopy, CallsThatWaitedPastTheirDeadlineAppendNothing) {
  EXPECT_EQ(late_append_.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  now_s_ = 1006;  // both deadlines pass while they wait
  store_.Open();
  ASSERT_TRUE(appended_.get().ok());
  EXPECT_EQ(late_append_.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(late_step_.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cache_->Info(a_)->lengths, (std::vector<int64_t>{32, 0}));
  // In time, the same calls append.
  EXPECT_TRUE(cache_->Append(a_, {{1, row_, row_}}, absl::FromUnixSeconds(2000)).ok());
  EXPECT_EQ(cache_->Info(a_)->lengths, (std::vector<int64_t>{32, 1}));
}

// A call waiting for another append to its sequence answers DEADLINE_EXCEEDED once its deadline
// passes, while that append is still copying (before, it waited for the copy however long that
// took, seconds for a large one, past its client's deadline).
TEST_F(LateCallsBehindACopy, CallsWaitingForAnotherAppendGiveUpAtTheirDeadline) {
  EXPECT_EQ(late_step_.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  now_s_ = 1006;  // the deadline passes; the first append is still copying
  const bool gave_up =
      late_append_.wait_for(std::chrono::seconds(5)) == std::future_status::ready &&
      late_step_.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  store_.Open();  // whatever happened, so that every thread ends
  ASSERT_TRUE(gave_up) << "calls kept waiting for another append past their deadline";
  EXPECT_EQ(late_append_.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(late_step_.get().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(appended_.get().ok());
  EXPECT_EQ(cache_->Info(a_)->lengths, (std::vector<int64_t>{32, 0}));
}

// A one-layer create of 32 prefix rows (d64 fp16), for a GatedStore to hold back; its rows point
// into `bits` (so it is neither copied nor moved).
struct GatedCreate {
  explicit GatedCreate(uint32_t seed) {
    std::mt19937 rng(seed);
    const kernels::DType f16 = kernels::DType::kFloat16;
    bits = testing::RandomRows(&rng, 32, 1, 64, f16);
    request.shape = {1, 1, 1, 64, f16};
    request.prefix = {{0, testing::Rows(bits, 1, 64, f16), testing::Rows(bits, 1, 64, f16)}};
  }
  GatedCreate(const GatedCreate&) = delete;
  GatedCreate& operator=(const GatedCreate&) = delete;
  testing::Bits bits;
  CreateRequest request;
};

// A CreateSequence whose deadline passed while its prefix was written is not kept: its client
// never learns the id (it would hold pages, unnamed, until its TTL).
TEST(SequenceCacheCreate, ASequenceWhosePrefixOutlivedItsDeadlineIsNotKept) {
  GatedStore store(/*gated_bytes=*/4096);
  std::atomic<int64_t> now_s{1000};
  std::unique_ptr<SequenceCache> cache = CacheWithClock(&store, &now_s);
  const GatedCreate gated(9);
  const CreateRequest& create = gated.request;
  auto created = std::async(std::launch::async, [&] {
    return cache->CreateSequence(create, absl::FromUnixSeconds(1005)).status();
  });
  store.WaitUntilBlocked();
  now_s = 1006;
  store.Open();
  EXPECT_EQ(created.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cache->Stats().sequences, 0);
  EXPECT_EQ(cache->Stats().used_bytes, 0);
  EXPECT_TRUE(cache->CreateSequence(create, absl::FromUnixSeconds(2000)).ok());  // in time: kept
  EXPECT_EQ(cache->Stats().sequences, 1);
}

// A client that cancels (or disconnects) while its prefix is written would leave a sequence
// nobody can name, holding its pages until the TTL (a cancelled CreateSequence filled the pool):
// not kept, as one past its deadline. A cancel that comes after the create finished changes
// nothing.
TEST(SequenceCacheCreate, ASequenceWhoseCallWasCancelledWhileItsPrefixWasWrittenIsNotKept) {
  GatedStore store(/*gated_bytes=*/4096);
  std::atomic<int64_t> now_s{1000};
  std::unique_ptr<SequenceCache> cache = CacheWithClock(&store, &now_s);
  const GatedCreate gated(11);
  const CreateRequest& create = gated.request;
  std::atomic<bool> cancelled{false};
  const std::function<bool()> is_cancelled = [&] { return cancelled.load(); };
  auto created = std::async(std::launch::async, [&] {
    return cache->CreateSequence(create, absl::InfiniteFuture(), is_cancelled).status();
  });
  store.WaitUntilBlocked();
  cancelled = true;
  store.Open();
  EXPECT_EQ(created.get().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(cache->Stats().sequences, 0);
  EXPECT_EQ(cache->Stats().used_bytes, 0);
  cancelled = false;
  absl::StatusOr<SequenceStatus> kept =
      cache->CreateSequence(create, absl::InfiniteFuture(), is_cancelled);
  ASSERT_TRUE(kept.ok());
  cancelled = true;  // after the answer: the sequence stays
  EXPECT_TRUE(cache->Info(kept->id).ok());
}

}  // namespace
}  // namespace flashserve::kvcache
