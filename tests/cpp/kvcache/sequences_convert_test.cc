// The Sequences edge's message checks: shapes against bytes (no overflow on absurd shapes),
// dtypes, optional k/v, scale, item counts, and outputs sized like q before anything runs.
#include "edge/sequences/sequences_convert.h"

#include <cmath>

#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_shm.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

v1::Tensor MakeTensor(v1::DType dtype, std::vector<int64_t> shape, size_t bytes) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::string(bytes, '\0'));
  return t;
}

TEST(SequencesConvert, RowsMustMatchTheirBytes) {
  EXPECT_TRUE(RowsFromTensor(MakeTensor(v1::FLOAT16, {3, 2, 8}, 96), "k", false).ok());
  EXPECT_EQ(RowsFromTensor(MakeTensor(v1::FLOAT16, {3, 2, 8}, 95), "k", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RowsFromTensor(MakeTensor(v1::FLOAT32, {3, 2, 8}, 192), "k", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RowsFromTensor(MakeTensor(v1::BFLOAT16, {6, 8}, 96), "k", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Products that overflow int64 are refused, not wrapped into a match.
  const int64_t big = int64_t(1) << 30;
  EXPECT_EQ(RowsFromTensor(MakeTensor(v1::FLOAT16, {big, big, big}, 0), "k", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RowsFromTensor(MakeTensor(v1::FLOAT16, {-1, 2, 8}, 0), "k", false).status().code(),
            absl::StatusCode::kInvalidArgument);
  absl::StatusOr<kvcache::HostRows> unset = RowsFromTensor(v1::Tensor(), "k", true);
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->rows, 0);
  EXPECT_FALSE(RowsFromTensor(v1::Tensor(), "k", false).ok());
}

TEST(SequencesConvert, Scale) {
  EXPECT_FLOAT_EQ(*ScaleFrom(false, 0.f, 64), 0.125f);
  EXPECT_FLOAT_EQ(*ScaleFrom(true, 0.5f, 64), 0.5f);
  for (float bad : {0.f, -1.f, NAN, INFINITY, 1e5f}) EXPECT_FALSE(ScaleFrom(true, bad, 64).ok());
}

TEST(SequencesConvert, DecodeStepChecksBeforeItSizesOutputs) {
  v1::DecodeStepRequest request;
  v1::DecodeStepResponse response;
  SequenceShm shm;  // shared memory off: every tensor inline
  EXPECT_EQ(BuildDecodeStep(request, 4, &shm, &response).status().code(),
            absl::StatusCode::kInvalidArgument);  // no items
  v1::DecodeItem* item = request.add_items();
  item->set_sequence_id("a");
  *item->mutable_q() = MakeTensor(v1::BFLOAT16, {17, 4, 8}, 17 * 4 * 8 * 2);
  EXPECT_EQ(BuildDecodeStep(request, 4, &shm, &response).status().code(),
            absl::StatusCode::kInvalidArgument);  // 17 query rows
  EXPECT_EQ(response.results_size(), 0) << "outputs allocated before the checks";
  *item->mutable_q() = MakeTensor(v1::BFLOAT16, {2, 4, 8}, 2 * 4 * 8 * 2);
  request.set_return_lse(true);
  absl::StatusOr<std::shared_ptr<DecodeCall>> call = BuildDecodeStep(request, 4, &shm, &response);
  ASSERT_TRUE(call.ok()) << call.status();
  ASSERT_EQ(response.results_size(), 1);
  EXPECT_EQ(response.results(0).out().data().size(), 2u * 4 * 8 * 2);
  EXPECT_EQ(response.results(0).lse().data().size(), 4u * 2 * 4);
  EXPECT_EQ((*call)->items[0].k.rows, 0);  // no k/v: attend only
  for (int i = 0; i < 4; ++i) *request.add_items() = request.items(0);
  EXPECT_EQ(BuildDecodeStep(request, 4, &shm, &response).status().code(),
            absl::StatusCode::kInvalidArgument);  // 5 items > 4
}

}  // namespace
}  // namespace flashserve
