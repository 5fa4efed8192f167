// The KV cache on the CUDA store: appends through the SequenceCache, one paged split-KV launch per
// step over sequences of different lengths (one empty), GQA, d64/d128, fp16/bf16, odd page sizes,
// checked against the fp64 reference. Skips without a GPU (label "gpu"; the lead runs these).
#include "runtime/cuda_kv_store.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
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

bool GpuAvailable() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

bool Compiled(int head_dim) {
  for (int d : kernels::cuda::decode_head_dims()) {
    if (d == head_dim) return true;
  }
  return false;
}

struct Case {
  DType dtype;
  int heads_q, heads_kv, head_dim, page_tokens;
};

class CudaKvStoreTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaKvStoreTest, StepsMatchFp64) {
  if (!GpuAvailable()) GTEST_SKIP() << "no CUDA GPU: skipping";
  const Case c = GetParam();
  if (!Compiled(c.head_dim)) GTEST_SKIP() << "head_dim " << c.head_dim << " not compiled";
  std::mt19937 rng(uint32_t(c.head_dim * 131 + c.page_tokens));
  int faults = 0;
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  absl::StatusOr<std::unique_ptr<CudaKvStore>> store =
      CudaKvStore::Create(
          64 << 20, 0,
          [sm_count](const kernels::cuda::DecodeParams& p) {
            return kernels::cuda::decode_num_splits(p, sm_count);
          },
          [&faults](cudaError_t e, const char* what) {
            ++faults;
            return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
          });
  ASSERT_TRUE(store.ok()) << store.status();
  KvCacheOptions options;
  options.capacity_bytes = 64 << 20;
  options.page_tokens = c.page_tokens;
  std::unique_ptr<SequenceCache> cache = *SequenceCache::Create(options, store->get(), nullptr);
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
    for (int i = 0; i < 4; ++i) {
      items.push_back({ids[size_t(i)], 0, Rows(qs[size_t(i)], c.heads_q, c.head_dim, c.dtype),
                       Rows(ks[size_t(i)], c.heads_kv, c.head_dim, c.dtype),
                       Rows(vs[size_t(i)], c.heads_kv, c.head_dim, c.dtype)});
    }
    absl::StatusOr<StepPlan> plan = cache->PrepareStep(items);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const bool causal = step == 5;
    const float scale = 1.f / std::sqrt(float(c.head_dim));
    plan->batch.causal = causal;
    plan->batch.softmax_scale = scale;
    std::vector<Bits> outs(4, Bits(qs[0].size(), 0x7e00));  // NaN-poisoned
    std::vector<std::vector<float>> lses(4, std::vector<float>(size_t(c.heads_q * rows_q), NAN));
    for (size_t i = 0; i < 4; ++i) {
      plan->batch.items[i].out = outs[i].data();
      plan->batch.items[i].lse = lses[i].data();
    }
    AttendInfo kernel;
    ASSERT_TRUE((*store)->Attend(plan->batch, &kernel).ok());
    for (size_t i = 0; i < 4; ++i) {
      dense[i].Append(ks[i], vs[i]);
      testing::CheckAgainstReference(s, dense[i], qs[i], rows_q, causal, scale, outs[i], lses[i],
                                     absl::StrCat("step ", step, " sequence ", i), true);
    }
  }
  EXPECT_EQ(faults, 0);
}

INSTANTIATE_TEST_SUITE_P(Grid, CudaKvStoreTest,
                         ::testing::Values(Case{DType::kBFloat16, 32, 8, 128, 64},
                                           Case{DType::kFloat16, 32, 8, 128, 16},
                                           Case{DType::kBFloat16, 8, 8, 64, 7},
                                           Case{DType::kFloat16, 12, 4, 64, 64}));

}  // namespace
}  // namespace flashserve::kvcache
