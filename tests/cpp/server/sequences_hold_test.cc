// What a Sequences call reserves against --max_inflight_bytes covers what its answer holds besides
// the request: O (q's size) and, with return_lse, LSE (4 bytes per row and head) -- also at
// head_dim 1 of a 2-byte dtype, where LSE is twice q's bytes.
#include "edge/sequences/sequences_hold.h"

#include <cstdint>
#include <string>

#include "gtest/gtest.h"

namespace flashserve {
namespace {

constexpr int64_t kRows = 3, kHeads = 5;

void SetQ(v1::Tensor* q, int64_t head_dim) {
  q->set_dtype(v1::FLOAT16);
  for (int64_t d : {kRows, kHeads, head_dim}) q->add_shape(d);
  q->set_data(std::string(size_t(kRows * kHeads * head_dim * 2), '\0'));
}

TEST(SequencesHold, ReservesOAndLseOfTheAnswer) {
  for (const int64_t head_dim : {int64_t{1}, int64_t{2}, int64_t{64}}) {
    const int64_t q_bytes = kRows * kHeads * head_dim * 2, lse_bytes = kRows * kHeads * 4;
    for (const bool lse : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "head_dim " << head_dim << ", return_lse " << lse);
      const int64_t answer = q_bytes + (lse ? lse_bytes : 0);
      v1::DecodeStepRequest items;
      items.set_return_lse(lse);
      SetQ(items.add_items()->mutable_q(), head_dim);
      EXPECT_GE(DecodeStepBytes(items), int64_t(items.ByteSizeLong()) + answer);
      v1::DecodeStepRequest packed;
      packed.set_return_lse(lse);
      SetQ(packed.mutable_packed()->mutable_q(), head_dim);
      EXPECT_GE(DecodeStepBytes(packed), int64_t(packed.ByteSizeLong()) + answer);
      v1::AttendRequest attend;
      attend.set_return_lse(lse);
      SetQ(attend.mutable_q(), head_dim);
      EXPECT_GE(AttendBytes(attend), int64_t(attend.ByteSizeLong()) + answer);
      // Outputs in a region are not in the answer.
      items.mutable_items(0)->mutable_out_shm()->set_region("r");
      items.mutable_items(0)->mutable_lse_shm()->set_region("r");
      EXPECT_EQ(DecodeStepBytes(items), int64_t(items.ByteSizeLong()));
    }
  }
}

}  // namespace
}  // namespace flashserve
