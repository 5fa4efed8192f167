// The CUDA store's writes against what its callers may do right after them (label "gpu"; skips
// without a GPU): a source in page-locked memory that the caller calls kHost (a message string the
// server's malloc took from the page-locked receive arena) is reused as soon as Append returns,
// with the stream busy ahead of the copy; rows appended where a Truncate inside a page cut rows
// that were still staged land over them. Every answer against the fp64 reference.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "flashserve/kernels/cuda_attention.h"
#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"
#include "runtime/cuda_kv_store.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::DenseLayer;
using testing::RandomRows;
using testing::Rows;

constexpr int kPageTokens = 64;
// 2 KiB rows: 64 of them (a page's worth, 128 KiB) go by the store's direct copy, 20 are staged.
const SequenceShape kShape{1, 8, 8, 128, DType::kFloat16};

struct Store {
  std::atomic<int> faults{0};
  std::unique_ptr<CudaKvStore> store;
  std::unique_ptr<SequenceCache> cache;
  Store() {
    absl::StatusOr<std::unique_ptr<CudaKvStore>> made = CudaKvStore::Create(
        64 << 20, 0, 2, [](const kernels::cuda::DecodeParams&) { return 1; },
        [this](cudaError_t e, const char* what) {
          ++faults;
          return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
        });
    EXPECT_TRUE(made.ok()) << made.status();
    if (!made.ok()) return;
    store = std::move(*made);
    KvCacheOptions options;
    options.capacity_bytes = 64 << 20;
    options.page_tokens = kPageTokens;
    cache = std::move(*SequenceCache::Create(options, store.get(), nullptr));
  }
  std::string Create(const Bits& k, const Bits& v) {
    CreateRequest request;
    request.shape = kShape;
    if (!k.empty()) request.prefix.push_back({0, RowsOf(k), RowsOf(v)});
    absl::StatusOr<SequenceStatus> created = cache->CreateSequence(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id : "";
  }
  static HostRows RowsOf(const Bits& bits) {
    return Rows(bits, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  }
  // One attend-only step of `id` with q (host memory), checked against `dense`.
  void CheckStep(const std::string& id, const DenseLayer& dense, std::mt19937* rng,
                 const std::string& where) {
    const Bits q = RandomRows(rng, 1, kShape.heads_q, kShape.head_dim, kShape.dtype);
    const Bits none;
    absl::StatusOr<StepPlan> plan =
        cache->PrepareStep({{id, 0, Rows(q, kShape.heads_q, kShape.head_dim, kShape.dtype),
                             RowsOf(none), RowsOf(none)}});
    ASSERT_TRUE(plan.ok()) << plan.status();
    const float scale = 1.f / std::sqrt(float(kShape.head_dim));
    plan->batch.softmax_scale = scale;
    Bits out(q.size(), 0xffff);  // NaN: an answer never written fails the check
    std::vector<float> lse(size_t(kShape.heads_q), NAN);
    plan->batch.items[0].out = out.data();
    plan->batch.items[0].lse = lse.data();
    AttendInfo info;
    ASSERT_TRUE(store->Attend(plan->batch, &info).ok());
    EXPECT_EQ(
        testing::CheckAgainstReference(kShape, dense, q, 1, false, scale, out, lse, where, true),
        0);
  }
};

bool Skip() { return !cuda_testing::GpuAvailable() || !cuda_testing::DecodeHeadDimCompiled(128); }

// Page-locked host memory of `bits`' size holding them.
struct PinnedCopy {
  void* data = nullptr;
  size_t bytes = 0;
  explicit PinnedCopy(const Bits& bits) : bytes(bits.size() * 2) {
    EXPECT_EQ(cudaHostAlloc(&data, bytes, cudaHostAllocDefault), cudaSuccess);
    std::memcpy(data, bits.data(), bytes);
  }
  ~PinnedCopy() { cudaFreeHost(data); }
};

TEST(CudaKvWrite, PageLockedRowsCalledHostMayBeReusedOnceAppendReturns) {
  if (Skip()) GTEST_SKIP() << "no CUDA GPU with the d128 decode kernel: skipping";
  std::mt19937 rng(std::random_device{}());
  Store s;
  ASSERT_NE(s.cache, nullptr);
  const std::string id = s.Create({}, {});
  const Bits k = RandomRows(&rng, 96, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  const Bits v = RandomRows(&rng, 96, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  PinnedCopy pinned_k(k), pinned_v(v);
  HostRows k_rows = Store::RowsOf(k), v_rows = Store::RowsOf(v);
  k_rows.data = pinned_k.data;  // at stays kHost: what the edge says of a message's bytes
  v_rows.data = pinned_v.data;
  // A second of device work queued ahead of the copies: they read their sources only after it.
  ASSERT_EQ(kernels::cuda::launch_hang_for_testing(s.store->stream_for_testing(), 1), cudaSuccess);
  ASSERT_TRUE(s.cache->Append(id, {{0, k_rows, v_rows}}).ok());
  std::memset(pinned_k.data, 0xff, pinned_k.bytes);  // the caller reuses them at once
  std::memset(pinned_v.data, 0xff, pinned_v.bytes);
  DenseLayer dense;
  dense.Append(k, v);
  s.CheckStep(id, dense, &rng, "rows appended from page-locked memory");
  EXPECT_EQ(s.faults.load(), 0);
}

// An append waiting for its page-locked sources to be read (behind a second of device work) holds
// up no one else: a step prepared meanwhile on another sequence (under the cache's lock) returns
// at once instead of waiting for that append's copies.
TEST(CudaKvWrite, AStepDoesNotWaitForAnotherCallsSources) {
  if (Skip()) GTEST_SKIP() << "no CUDA GPU with the d128 decode kernel: skipping";
  std::mt19937 rng(std::random_device{}());
  Store s;
  ASSERT_NE(s.cache, nullptr);
  const std::string appended = s.Create({}, {});
  const Bits k0 = RandomRows(&rng, 3, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  const std::string stepped = s.Create(k0, k0);
  DenseLayer dense;
  dense.Append(k0, k0);
  // One step first: the kernels a flush and a step launch are loaded now (the first launch of a
  // kernel waits for the device when CUDA loads modules lazily, which is not what is measured).
  s.CheckStep(stepped, dense, &rng, "warm-up step");
  const Bits k = RandomRows(&rng, 96, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  PinnedCopy pinned(k);
  HostRows rows = Store::RowsOf(k);
  rows.data = pinned.data;  // kHost, as the edge says of a message's bytes
  ASSERT_EQ(kernels::cuda::launch_hang_for_testing(s.store->stream_for_testing(), 1), cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  std::thread append([&] { EXPECT_TRUE(s.cache->Append(appended, {{0, rows, rows}}).ok()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // its copies queued, it waits
  const Bits one = RandomRows(&rng, 1, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  const Bits q = RandomRows(&rng, 1, kShape.heads_q, kShape.head_dim, kShape.dtype);
  absl::StatusOr<StepPlan> plan =
      s.cache->PrepareStep({{stepped, 0, Rows(q, kShape.heads_q, kShape.head_dim, kShape.dtype),
                             Store::RowsOf(one), Store::RowsOf(one)}});
  const auto prepared = std::chrono::steady_clock::now();
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan.value() = StepPlan();  // unpinned
  append.join();
  const auto appended_at = std::chrono::steady_clock::now();
  EXPECT_LT(prepared - start, std::chrono::milliseconds(700)) << "the step waited for the append";
  EXPECT_GT(appended_at - start, std::chrono::milliseconds(900)) << "the append did not wait";
  EXPECT_EQ(s.faults.load(), 0);
}

TEST(CudaKvWrite, RowsAppendedWhereATruncateCutStagedRowsLandOverThem) {
  if (Skip()) GTEST_SKIP() << "no CUDA GPU with the d128 decode kernel: skipping";
  std::mt19937 rng(std::random_device{}());
  Store s;
  ASSERT_NE(s.cache, nullptr);
  for (int round = 0; round < 20; ++round) {  // the scatter's order is the GPU's: several tries
    const Bits k = RandomRows(&rng, 20, kShape.heads_kv, kShape.head_dim, kShape.dtype);
    const Bits v = RandomRows(&rng, 20, kShape.heads_kv, kShape.head_dim, kShape.dtype);
    const std::string id = s.Create(k, v);  // staged: no launch yet
    ASSERT_TRUE(s.cache->Truncate({{id, 5, {}}}).ok());
    const Bits k2 = RandomRows(&rng, 15, kShape.heads_kv, kShape.head_dim, kShape.dtype);
    const Bits v2 = RandomRows(&rng, 15, kShape.heads_kv, kShape.head_dim, kShape.dtype);
    ASSERT_TRUE(s.cache->Append(id, {{0, Store::RowsOf(k2), Store::RowsOf(v2)}}).ok());
    const size_t kept = size_t(5 * kShape.heads_kv * kShape.head_dim);
    DenseLayer dense;
    dense.Append(Bits(k.begin(), k.begin() + long(kept)), Bits(v.begin(), v.begin() + long(kept)));
    dense.Append(k2, v2);
    s.CheckStep(id, dense, &rng, absl::StrCat("round ", round));
    s.cache->Release({id});
  }
  EXPECT_EQ(s.faults.load(), 0);
}

// Staged rows lost to a failed flush: Append had answered OK for them, so every later answer
// over that sequence would attend rows never written. The store refuses everything from then on
// (UNAVAILABLE) and tells its backend once, which reports not live so the process is replaced.
TEST(CudaKvWrite, RowsLostToAFailedFlushBreakTheStoreForGood) {
  if (Skip()) GTEST_SKIP() << "no CUDA GPU with the d128 decode kernel: skipping";
  std::mt19937 rng(std::random_device{}());
  Store s;
  ASSERT_NE(s.cache, nullptr);
  std::vector<std::string> broken;
  s.store->set_on_broken([&](const absl::Status& why) { broken.push_back(why.ToString()); });
  const Bits k = RandomRows(&rng, 20, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  const Bits v = RandomRows(&rng, 20, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  const std::string id = s.Create(k, v);  // 20 rows of 2 KiB: staged, not flushed yet
  s.store->FailNextFlushForTesting();
  const Bits q = RandomRows(&rng, 1, kShape.heads_q, kShape.head_dim, kShape.dtype);
  const Bits none;
  absl::StatusOr<StepPlan> plan =
      s.cache->PrepareStep({{id, 0, Rows(q, kShape.heads_q, kShape.head_dim, kShape.dtype),
                             Store::RowsOf(none), Store::RowsOf(none)}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan->batch.softmax_scale = 0.1f;
  Bits out(q.size(), 0xffff);
  plan->batch.items[0].out = out.data();
  AttendInfo info;
  const absl::Status attended = s.store->Attend(plan->batch, &info);
  EXPECT_EQ(attended.code(), absl::StatusCode::kUnavailable) << attended;
  ASSERT_EQ(broken.size(), 1u);
  EXPECT_NE(broken[0].find("lost rows"), std::string::npos) << broken[0];
  // Later calls: refused, the backend not told again.
  const absl::StatusOr<AppendResult> appended =
      s.cache->Append(id, {{0, Store::RowsOf(k), Store::RowsOf(v)}});
  EXPECT_EQ(appended.status().code(), absl::StatusCode::kUnavailable) << appended.status();
  const Bits big_k = RandomRows(&rng, 64, kShape.heads_kv, kShape.head_dim, kShape.dtype);
  EXPECT_EQ(s.store->Write(0, big_k.data(), int64_t(big_k.size() * 2), BytesAt::kHost).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.store->Attend(plan->batch, &info).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(broken.size(), 1u);
}

}  // namespace
}  // namespace flashserve::kvcache
