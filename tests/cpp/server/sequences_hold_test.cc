// What a Sequences call reserves against --max_inflight_bytes, and what the inline-answer cap
// reads, is what its answer holds besides the request: O (q's size) and, with return_lse, LSE
// (4 bytes per row and head) -- exactly, from q's shape and dtype (2 * q's bytes, the most LSE can
// be, refused d256 steps whose answers fit a message), and twice q's bytes without a shape.
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
      EXPECT_EQ(DecodeStepBytes(items), int64_t(items.ByteSizeLong()) + answer);
      v1::DecodeStepRequest packed;
      packed.set_return_lse(lse);
      SetQ(packed.mutable_packed()->mutable_q(), head_dim);
      EXPECT_EQ(DecodeStepBytes(packed), int64_t(packed.ByteSizeLong()) + answer);
      v1::AttendRequest attend;
      attend.set_return_lse(lse);
      SetQ(attend.mutable_q(), head_dim);
      EXPECT_EQ(AttendBytes(attend), int64_t(attend.ByteSizeLong()) + answer);
      // Outputs in a region are not in the answer.
      items.mutable_items(0)->mutable_out_shm()->set_region("r");
      items.mutable_items(0)->mutable_lse_shm()->set_region("r");
      EXPECT_EQ(DecodeStepBytes(items), int64_t(items.ByteSizeLong()));
    }
  }
}

// A shape the bytes contradict is refused before an answer is made; the estimate must only stay
// positive and not overflow. No usable last dimension: 2 * q's bytes.
TEST(SequencesHold, LseFromAShapeThatSaysNothingUsable) {
  v1::Tensor q;
  q.set_dtype(v1::BFLOAT16);
  q.set_data(std::string(64, '\0'));
  EXPECT_EQ(LseBytesAtMost(q, 64), 128);  // no shape
  q.add_shape(0);
  EXPECT_EQ(LseBytesAtMost(q, 64), 128);
  q.set_shape(0, -5);
  EXPECT_EQ(LseBytesAtMost(q, 64), 128);
  q.set_shape(0, INT64_MAX);
  EXPECT_EQ(LseBytesAtMost(q, 64), 1);  // rounded up, never 0 for bytes that exist
  q.set_shape(0, 8);
  q.set_dtype(v1::FLOAT32);
  EXPECT_EQ(LseBytesAtMost(q, 64), 8);  // 2 rows of 8 floats
}

}  // namespace
}  // namespace flashserve
