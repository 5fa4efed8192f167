// The KV cache on the CUDA store: appends through the SequenceCache, one paged split-KV launch per
// step over sequences of different lengths (one empty), GQA, d64/d128, fp16/bf16, odd page sizes,
// checked against the fp64 reference. The items' q / k / v / O / LSE live in pageable host memory,
// device memory (a client's CUDA region), page-locked host memory (a registered system region) or
// a mix of them; or, as a packed DecodeStep's region puts them, every item's q back to back and
// every O back to back in device or page-locked memory, which the kernel reads and writes in
// place. Skips
// without a GPU (label "gpu"; the lead runs these).
#include "runtime/cuda_kv_store.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "cuda_test_util.h"
#include "flashserve/kernels/decode_attention.h"
#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::DenseLayer;
using testing::RandomRows;
using testing::Rows;

using cuda_testing::DecodeHeadDimCompiled;
using cuda_testing::GpuAvailable;

// Where a test puts an item's tensor; kMixed: each tensor of each item somewhere else;
// k*Packed: device / page-locked memory, the items' queries back to back, and their outputs.
enum class Place { kHost, kDevice, kPinned, kMixed, kDevicePacked, kPinnedPacked };

// One step's tensors in one kind of memory, bump-allocated; `skew` bytes past 16-byte alignment.
class Arena {
 public:
  Arena(Place place, size_t bytes) : place_(place), bytes_(bytes) {
    if (place == Place::kDevice || place == Place::kDevicePacked) {
      place_ = Place::kDevice;
      EXPECT_EQ(cudaMalloc(&base_, bytes), cudaSuccess);
      return;
    }
    if (place == Place::kPinnedPacked) place_ = Place::kPinned;
    base_ = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (place_ == Place::kPinned) {
      EXPECT_EQ(cudaHostRegister(base_, bytes, cudaHostRegisterDefault), cudaSuccess);
    }
  }
  ~Arena() {
    if (place_ == Place::kDevice) {
      cudaFree(base_);
      return;
    }
    if (place_ == Place::kPinned) cudaHostUnregister(base_);
    std::free(base_);
  }
  BytesAt at() const {
    return place_ == Place::kDevice   ? BytesAt::kDevice
           : place_ == Place::kPinned ? BytesAt::kPageLocked
                                      : BytesAt::kHost;
  }
  // `bytes` of 0xff (NaN in fp16, bf16 and fp32) or of `src`.
  char* Take(size_t bytes, int skew, const void* src = nullptr) {
    used_ = (used_ + 15) / 16 * 16 + size_t(skew);
    char* p = static_cast<char*>(base_) + used_;
    used_ += bytes;
    EXPECT_LE(used_, bytes_);
    if (src != nullptr) {
      EXPECT_EQ(cudaMemcpy(p, src, bytes, cudaMemcpyDefault), cudaSuccess);
    } else {
      EXPECT_EQ(place_ == Place::kDevice ? cudaMemset(p, 0xff, bytes)
                                         : (std::memset(p, 0xff, bytes), cudaSuccess),
                cudaSuccess);
    }
    return p;
  }
  HostRows Put(const Bits& bits, int64_t heads, int64_t head_dim, DType dtype, int skew) {
    HostRows rows = Rows(bits, heads, head_dim, dtype);
    rows.data = Take(bits.size() * 2, skew, bits.data());
    rows.at = at();
    return rows;
  }

 private:
  Place place_;
  size_t bytes_;
  void* base_ = nullptr;
  size_t used_ = 0;
};

// A store of `bytes` on device 0 with `slots` launches in flight, split counts from the
// heuristic; CUDA errors count in `*faults`.
std::unique_ptr<CudaKvStore> MakeStore(int64_t bytes, int slots, std::atomic<int>* faults) {
  int sm_count = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  absl::StatusOr<std::unique_ptr<CudaKvStore>> store = CudaKvStore::Create(
      bytes, 0, slots,
      [sm_count](const kernels::cuda::DecodeParams& p) {
        return kernels::cuda::decode_num_splits(p, sm_count);
      },
      [faults](cudaError_t e, const char* what) {
        ++*faults;
        return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
      });
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(*store) : nullptr;
}

template <typename T>
std::vector<T> Fetch(const void* src, size_t count) {
  std::vector<T> out(count);
  EXPECT_EQ(cudaMemcpy(out.data(), src, count * sizeof(T), cudaMemcpyDefault), cudaSuccess);
  return out;
}

struct Case {
  DType dtype;
  int heads_q, heads_kv, head_dim, page_tokens;
  Place place = Place::kHost;
};

class CudaKvStoreTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaKvStoreTest, StepsMatchFp64) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  const Case c = GetParam();
  if (!DecodeHeadDimCompiled(c.head_dim))
    GTEST_SKIP() << "head_dim " << c.head_dim << " not compiled";
  std::mt19937 rng(uint32_t(c.head_dim * 131 + c.page_tokens));
  std::atomic<int> faults{0};
  int host_pointers_work = 0;
  ASSERT_EQ(
      cudaDeviceGetAttribute(&host_pointers_work, cudaDevAttrCanUseHostPointerForRegisteredMem, 0),
      cudaSuccess);
  // Two slots: consecutive steps take them in turn (each grows its own scratch).
  std::unique_ptr<CudaKvStore> store = MakeStore(64 << 20, 2, &faults);
  ASSERT_NE(store, nullptr);
  KvCacheOptions options;
  options.capacity_bytes = 64 << 20;
  options.page_tokens = c.page_tokens;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, store.get(), nullptr);
  SequenceShape s{1, c.heads_q, c.heads_kv, c.head_dim, c.dtype};
  const int prefixes[] = {0, 1, 37, 300};  // empty, one row, mid-page, many pages
  std::vector<std::string> ids;
  std::vector<DenseLayer> dense(4);
  for (int i = 0; i < 4; ++i) {
    Bits k = RandomRows(&rng, prefixes[i], c.heads_kv, c.head_dim, c.dtype);
    Bits v = RandomRows(&rng, prefixes[i], c.heads_kv, c.head_dim, c.dtype);
    dense[size_t(i)].Append(k, v);
    CreateRequest request;
    request.shape = s;
    request.prefix.push_back(
        {0, Rows(k, c.heads_kv, c.head_dim, c.dtype), Rows(v, c.heads_kv, c.head_dim, c.dtype)});
    absl::StatusOr<SequenceStatus> created = cache->CreateSequence(request);
    ASSERT_TRUE(created.ok()) << created.status();
    ids.push_back(created->id);
  }
  for (int step = 0; step < 6; ++step) {
    const int rows_q = step == 5 ? 3 : 1;
    const int new_rows = step == 0 ? 0 : rows_q;  // step 0 attends only (one sequence empty)
    std::vector<Bits> qs, ks, vs;
    std::vector<StepItem> items;
    for (int i = 0; i < 4; ++i) {
      qs.push_back(RandomRows(&rng, rows_q, c.heads_q, c.head_dim, c.dtype));
      ks.push_back(RandomRows(&rng, new_rows, c.heads_kv, c.head_dim, c.dtype));
      vs.push_back(RandomRows(&rng, new_rows, c.heads_kv, c.head_dim, c.dtype));
    }
    // Tensor t of item i: in arena (i + t) % 3 when mixed; item 3's at odd (2-byte) offsets.
    std::vector<std::unique_ptr<Arena>> arenas;
    for (Place p : {Place::kHost, Place::kDevice, Place::kPinned}) {
      arenas.push_back(std::make_unique<Arena>(c.place == Place::kMixed ? p : c.place, 4 << 20));
    }
    auto arena = [&](int i, int t) -> Arena& {
      return *arenas[c.place == Place::kMixed ? size_t((i + t) % 3) : 0];
    };
    const bool packed = c.place == Place::kDevicePacked || c.place == Place::kPinnedPacked;
    std::vector<HostRows> q_rows;  // packed: every q first, back to back
    for (int i = 0; i < 4 && packed; ++i) {
      q_rows.push_back(arena(i, 0).Put(qs[size_t(i)], c.heads_q, c.head_dim, c.dtype, 0));
    }
    for (int i = 0; i < 4; ++i) {
      const int skew = i == 3 && !packed ? 2 : 0;
      items.push_back({ids[size_t(i)], 0,
                       packed
                           ? q_rows[size_t(i)]
                           : arena(i, 0).Put(qs[size_t(i)], c.heads_q, c.head_dim, c.dtype, skew),
                       arena(i, 1).Put(ks[size_t(i)], c.heads_kv, c.head_dim, c.dtype, skew),
                       arena(i, 2).Put(vs[size_t(i)], c.heads_kv, c.head_dim, c.dtype, skew)});
    }
    absl::StatusOr<StepPlan> plan = cache->PrepareStep(items);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const bool causal = step == 5;
    const float scale = 1.f / std::sqrt(float(c.head_dim));
    plan->batch.causal = causal;
    plan->batch.softmax_scale = scale;
    const size_t lse_count = size_t(c.heads_q * rows_q);
    for (size_t i = 0; i < 4; ++i) {  // NaN-poisoned outputs (packed: back to back)
      PagedItem& item = plan->batch.items[i];
      item.out = arena(int(i), 3).Take(qs[i].size() * 2, i == 3 && !packed ? 2 : 0);
      item.out_at = arena(int(i), 3).at();
    }
    for (size_t i = 0; i < 4; ++i) {
      PagedItem& item = plan->batch.items[i];
      item.lse = reinterpret_cast<float*>(arena(int(i), 4).Take(lse_count * 4, 0));
      item.lse_at = arena(int(i), 4).at();
    }
    AttendInfo kernel;
    ASSERT_TRUE(store->Attend(plan->batch, &kernel).ok());
    // Only packed rows are used in place (kDevice has item 3 at an odd offset), page-locked ones
    // where the device addresses them.
    const bool in_place = packed && (c.place == Place::kDevicePacked || host_pointers_work);
    EXPECT_EQ(kernel.q_in_place, in_place);
    EXPECT_EQ(kernel.out_in_place, in_place);
    std::vector<Bits> outs;
    std::vector<std::vector<float>> lses;
    for (const PagedItem& item : plan->batch.items) {
      outs.push_back(Fetch<uint16_t>(item.out, qs[0].size()));
      lses.push_back(Fetch<float>(item.lse, lse_count));
    }
    for (size_t i = 0; i < 4; ++i) {
      dense[i].Append(ks[i], vs[i]);
      testing::CheckAgainstReference(s, dense[i], qs[i], rows_q, causal, scale, outs[i], lses[i],
                                     absl::StrCat("step ", step, " sequence ", i), true);
    }
  }
  EXPECT_EQ(faults.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, CudaKvStoreTest,
    ::testing::Values(Case{DType::kBFloat16, 32, 8, 128, 64}, Case{DType::kFloat16, 32, 8, 128, 16},
                      Case{DType::kBFloat16, 8, 8, 64, 7}, Case{DType::kFloat16, 12, 4, 64, 64},
                      Case{DType::kBFloat16, 32, 8, 128, 64, Place::kDevice},
                      Case{DType::kFloat16, 12, 4, 64, 7, Place::kDevice},
                      Case{DType::kBFloat16, 32, 8, 128, 16, Place::kPinned},
                      Case{DType::kFloat16, 32, 8, 128, 64, Place::kMixed},
                      Case{DType::kBFloat16, 12, 4, 64, 7, Place::kMixed},
                      Case{DType::kBFloat16, 32, 8, 128, 64, Place::kDevicePacked},
                      Case{DType::kFloat16, 12, 4, 64, 7, Place::kDevicePacked},
                      Case{DType::kFloat16, 32, 8, 128, 16, Place::kPinnedPacked},
                      Case{DType::kBFloat16, 8, 8, 64, 7, Place::kPinnedPacked}));

// Lets `threads` threads into their next Attend together, so that their launches overlap (the
// reference checks between steps take far longer than a launch). Gives up waiting after 10 s: a
// thread that stopped on a failed assertion does not hang the others.
// The split count is chosen for the launch as it runs: paged, with packed rows (it was asked with
// no block table: a dense plan, the tuner's class without the page size, workspace for batch x
// the longest item's rows).
TEST(CudaKvStoreSplits, TheChooserSeesAPagedPackedLaunch) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  if (!DecodeHeadDimCompiled(64)) GTEST_SKIP() << "head_dim 64 not compiled";
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  std::vector<kernels::cuda::DecodeParams> asked;
  absl::StatusOr<std::unique_ptr<CudaKvStore>> store = CudaKvStore::Create(
      64 << 20, 0, 1,
      [&](const kernels::cuda::DecodeParams& p) {
        asked.push_back(p);
        return kernels::cuda::decode_num_splits(p, sm_count);
      },
      [](cudaError_t e, const char* what) {
        return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
      });
  ASSERT_TRUE(store.ok()) << store.status();
  KvCacheOptions options;
  options.capacity_bytes = 64 << 20;
  options.page_tokens = 16;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, store->get(), nullptr);
  const SequenceShape s{1, 4, 2, 64, DType::kFloat16};
  std::mt19937 rng(7);
  std::vector<StepItem> items;
  std::vector<Bits> keep;
  for (int rows_q : {1, 5}) {
    CreateRequest request;
    request.shape = s;
    absl::StatusOr<SequenceStatus> created = cache->CreateSequence(request);
    ASSERT_TRUE(created.ok()) << created.status();
    keep.push_back(RandomRows(&rng, rows_q, s.heads_q, s.head_dim, s.dtype));
    keep.push_back(RandomRows(&rng, rows_q, s.heads_kv, s.head_dim, s.dtype));
    keep.push_back(RandomRows(&rng, rows_q, s.heads_kv, s.head_dim, s.dtype));
    const size_t n = keep.size();
    items.push_back({created->id, 0, Rows(keep[n - 3], s.heads_q, s.head_dim, s.dtype),
                     Rows(keep[n - 2], s.heads_kv, s.head_dim, s.dtype),
                     Rows(keep[n - 1], s.heads_kv, s.head_dim, s.dtype)});
  }
  absl::StatusOr<StepPlan> plan = cache->PrepareStep(items);
  ASSERT_TRUE(plan.ok()) << plan.status();
  plan->batch.softmax_scale = 0.125f;
  std::vector<std::vector<char>> outputs;
  for (PagedItem& item : plan->batch.items) {
    outputs.emplace_back(size_t(item.rows_q) * s.heads_q * s.head_dim * 2 + 4 * s.heads_q * 8);
    item.out = outputs.back().data();
    item.lse = reinterpret_cast<float*>(outputs.back().data() +
                                        size_t(item.rows_q) * s.heads_q * s.head_dim * 2);
  }
  AttendInfo info;
  ASSERT_TRUE((*store)->Attend(plan->batch, &info).ok());
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_NE(asked[0].block_table, nullptr);
  EXPECT_EQ(asked[0].page_size, 16);
  EXPECT_NE(asked[0].cu_seqlens_q, nullptr);
  EXPECT_NE(asked[0].seqlens_k, nullptr);
  EXPECT_EQ(asked[0].total_q, 6);
}

class StepGate {
 public:
  explicit StepGate(int threads) : threads_(threads) {}
  void Arrive(int step) {
    arrived_.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived_.load() < threads_ * (step + 1) && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  }

 private:
  const int threads_;
  std::atomic<int> arrived_{0};
};

// Threads stepping their own sequences at once, with 1-3 launches in flight: a launch queued
// while another runs must not take its scratch, outputs or timing events (every answer against
// the fp64 reference, outputs NaN-poisoned; the pageable and the device-region paths). The
// threads enter each Attend together so that launches are queued behind running ones. Not
// caught (checked on the H200): a store whose launches all use one slot's scratch and events --
// the one stream orders their device work, and what is left (a launch's copy-out from pinned
// memory racing the next launch's D2H into it) is a window of microseconds this test misses.
TEST(CudaKvStoreConcurrency, LaunchesInFlightKeepTheirOwnScratch) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  if (!DecodeHeadDimCompiled(128)) GTEST_SKIP() << "head_dim 128 not compiled";
  const SequenceShape s{1, 32, 8, 128, DType::kBFloat16};
  constexpr int kThreads = 4, kPerThread = 3, kSteps = 12;
  for (int slots : {1, 2, 3}) {
    std::atomic<int> faults{0};
    std::unique_ptr<CudaKvStore> store = MakeStore(256 << 20, slots, &faults);
    ASSERT_NE(store, nullptr);
    KvCacheOptions options;
    options.capacity_bytes = 256 << 20;
    options.page_tokens = 64;
    std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, store.get(), nullptr);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    StepGate gate(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(uint32_t(1000 * slots + t));
        std::vector<DenseLayer> dense(kPerThread);
        std::vector<std::string> ids;
        for (int i = 0; i < kPerThread; ++i) {  // unequal lengths: different split counts
          const int prefix = 50 + 700 * i + 97 * t;
          Bits k = RandomRows(&rng, prefix, s.heads_kv, s.head_dim, s.dtype);
          Bits v = RandomRows(&rng, prefix, s.heads_kv, s.head_dim, s.dtype);
          dense[size_t(i)].Append(k, v);
          CreateRequest request;
          request.shape = s;
          request.prefix.push_back({0, Rows(k, s.heads_kv, s.head_dim, s.dtype),
                                    Rows(v, s.heads_kv, s.head_dim, s.dtype)});
          ids.push_back(cache->CreateSequence(request)->id);
        }
        for (int step = 0; step < kSteps; ++step) {
          // Odd threads keep q and O in device memory (a CUDA region), packed: read in place.
          Arena arena(t % 2 == 1 ? Place::kDevicePacked : Place::kHost, 4 << 20);
          std::vector<Bits> qs, ks, vs;
          std::vector<StepItem> items;
          std::vector<HostRows> q_rows;
          for (int i = 0; i < kPerThread; ++i) {
            qs.push_back(RandomRows(&rng, 1, s.heads_q, s.head_dim, s.dtype));
            ks.push_back(RandomRows(&rng, 1, s.heads_kv, s.head_dim, s.dtype));
            vs.push_back(RandomRows(&rng, 1, s.heads_kv, s.head_dim, s.dtype));
            q_rows.push_back(arena.Put(qs.back(), s.heads_q, s.head_dim, s.dtype, 0));
          }
          for (int i = 0; i < kPerThread; ++i) {
            items.push_back({ids[size_t(i)], 0, q_rows[size_t(i)],
                             Rows(ks[size_t(i)], s.heads_kv, s.head_dim, s.dtype),
                             Rows(vs[size_t(i)], s.heads_kv, s.head_dim, s.dtype)});
          }
          absl::StatusOr<StepPlan> plan = cache->PrepareStep(items);
          ASSERT_TRUE(plan.ok()) << plan.status();
          plan->batch.softmax_scale = 1.f / std::sqrt(float(s.head_dim));
          std::vector<std::vector<float>> lses(kPerThread);
          for (int i = 0; i < kPerThread; ++i) {
            PagedItem& item = plan->batch.items[size_t(i)];
            item.out = arena.Take(qs[0].size() * 2, 0);  // NaN-poisoned
            item.out_at = arena.at();
            lses[size_t(i)].assign(size_t(s.heads_q), std::nanf(""));
            item.lse = lses[size_t(i)].data();
          }
          AttendInfo info;
          gate.Arrive(step);
          const absl::Status st = store->Attend(plan->batch, &info);
          ASSERT_TRUE(st.ok()) << st;
          for (int i = 0; i < kPerThread; ++i) {
            const Bits out = Fetch<uint16_t>(plan->batch.items[size_t(i)].out, qs[0].size());
            dense[size_t(i)].Append(ks[size_t(i)], vs[size_t(i)]);
            failures += testing::CheckAgainstReference(
                s, dense[size_t(i)], qs[size_t(i)], 1, false, plan->batch.softmax_scale, out,
                lses[size_t(i)],
                absl::StrCat(slots, " slots, thread ", t, " step ", step, " sequence ", i), true);
          }
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    EXPECT_EQ(failures.load(), 0) << slots << " slots";
    EXPECT_EQ(faults.load(), 0) << slots << " slots";
  }
}

}  // namespace
}  // namespace flashserve::kvcache
