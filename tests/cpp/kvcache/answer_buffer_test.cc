// A DecodeStep's answer sent from the buffer its outputs were computed into
// (edge/sequences/answer_buffer.h): the pieces parse back to exactly the message with the data
// filled in, whatever mix of results is in the buffer, inline in the message, or in a region; and
// BuildDecodeStep puts every output that travels in the answer into the buffer when the pool has
// room, into the message when it has not.
#include "edge/sequences/answer_buffer.h"

#include <random>
#include <string>
#include <vector>

#include "edge/sequences/sequences_decode.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

std::string RandomBytes(size_t n, std::mt19937* rng) {
  std::string bytes(n, '\0');
  for (char& c : bytes) c = char((*rng)() & 0xff);
  return bytes;
}

// Malloc'd memory the pool believes page-locked (what the CUDA backend's pool is), or not.
std::unique_ptr<PinnedPool> Pool(size_t capacity, bool page_locked) {
  PinnedPoolOptions options;
  options.capacity_bytes = capacity;
  options.page_locked = page_locked;
  return *PinnedPool::Create(options, std::make_unique<HeapAllocator>());
}

std::string Concatenate(const AnswerPieces& pieces, const AnswerBuffer* buffer) {
  std::string wire;
  for (const AnswerPieces::Piece& piece : pieces.pieces) wire += pieces.View(piece, buffer);
  EXPECT_EQ(wire.size(), pieces.total_bytes);
  return wire;
}

void SetShape(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape) {
  t->set_dtype(dtype);
  for (int64_t d : shape) t->add_shape(d);
}

// Results whose out / lse are, at random, in the buffer, inline, or only described (in a region);
// the expected message has every buffer tensor's data filled in.
TEST(AnswerBuffer, PiecesParseBackToTheMessageWithItsData) {
  std::mt19937 rng(20261128);
  std::unique_ptr<PinnedPool> pool = Pool(size_t{64} << 20, true);
  for (int round = 0; round < 40; ++round) {
    const int results = 1 + int(rng() % 9);
    std::shared_ptr<AnswerBuffer> buffer = AnswerBuffer::Acquire(pool.get(), 1 << 16, 1 << 12);
    ASSERT_NE(buffer, nullptr);
    EXPECT_EQ(buffer->at(), kvcache::BytesAt::kPageLocked);
    v1::DecodeStepResponse response, expected;
    for (int i = 0; i < results; ++i) {
      const int64_t rows = 1 + int64_t(rng() % 4), heads = 1 + int64_t(rng() % 3), dim = 8;
      v1::DecodeResult* r = response.add_results();
      SetShape(r->mutable_out(), v1::FLOAT16, {rows, heads, dim});
      const bool with_lse = rng() % 2 == 0;
      if (with_lse) SetShape(r->mutable_lse(), v1::FLOAT32, {heads, rows});
      if (rng() % 3) r->set_length(int64_t(rng() % 100000));
      v1::DecodeResult* want = expected.add_results();
      *want = *r;
      auto place = [&](v1::Tensor* t, v1::Tensor* want_t, size_t bytes, bool lse) {
        const std::string data = RandomBytes(bytes, &rng);
        switch (rng() % 3) {
          case 0: {  // in the buffer
            char* at = lse ? buffer->TakeLse(bytes, t) : buffer->TakeOut(bytes, t);
            ASSERT_NE(at, nullptr);
            std::copy(data.begin(), data.end(), at);
            want_t->set_data(data);
            break;
          }
          case 1:  // inline in the message
            t->set_data(data);
            want_t->set_data(data);
            break;
          default:  // in a client's region: dtype and shape only
            break;
        }
      };
      place(r->mutable_out(), want->mutable_out(), size_t(rows * heads * dim * 2), false);
      if (with_lse) place(r->mutable_lse(), want->mutable_lse(), size_t(heads * rows * 4), true);
    }
    response.set_kernel("decode-kernel");
    response.set_batched_calls(1 + int32_t(rng() % 5));
    response.mutable_timing()->set_total_us(int64_t(rng() % 5000));
    *expected.mutable_timing() = response.timing();
    expected.set_kernel(response.kernel());
    expected.set_batched_calls(response.batched_calls());

    const AnswerPieces pieces = EncodeDecodeStepAnswer(&response, buffer.get());
    EXPECT_EQ(response.results_size(), 0) << "the results are consumed";
    v1::DecodeStepResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(Concatenate(pieces, buffer.get())));
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(parsed, expected))
        << "round " << round << "\n"
        << parsed.ShortDebugString().substr(0, 400);
    for (size_t i = 1; i < pieces.pieces.size(); ++i) {  // adjacent header bytes are one piece
      EXPECT_TRUE(pieces.pieces[i].in_buffer || pieces.pieces[i - 1].in_buffer);
    }
  }
}

TEST(AnswerBuffer, PartsAreBoundedAndAligned) {
  std::unique_ptr<PinnedPool> pool = Pool(size_t{1} << 20, false);
  std::shared_ptr<AnswerBuffer> buffer = AnswerBuffer::Acquire(pool.get(), 1000, 40);
  ASSERT_NE(buffer, nullptr);
  EXPECT_EQ(buffer->at(), kvcache::BytesAt::kHost);
  v1::Tensor a, b, c;
  char* first = buffer->TakeOut(600, &a);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(buffer->TakeOut(600, &b), nullptr) << "past the O part";
  EXPECT_EQ(buffer->TakeOut(400, &b), first + 600) << "back to back";
  char* lse = buffer->TakeLse(40, &c);
  ASSERT_NE(lse, nullptr);
  EXPECT_EQ((lse - first) % 256, 0);
  EXPECT_GE(lse, first + 1000);
  EXPECT_EQ(buffer->TakeLse(1, &c), nullptr);
  EXPECT_EQ(buffer->spans().size(), 3u);
  EXPECT_EQ(AnswerBuffer::Acquire(nullptr, 1000, 0), nullptr);
  EXPECT_EQ(AnswerBuffer::Acquire(Pool(0, false).get(), 1000, 0), nullptr) << "no room";
}

// A packed step of three sequences (rows 1, 2, 1), d8, 4 query heads, inline q / k / v.
v1::DecodeStepRequest PackedStep(bool return_lse, std::mt19937* rng) {
  v1::DecodeStepRequest request;
  request.set_return_lse(return_lse);
  v1::PackedDecodeRows* p = request.mutable_packed();
  for (int rows : {1, 2, 1}) {
    request.add_items()->set_sequence_id("s" + std::to_string(p->rows_q_size()));
    p->add_rows_q(rows);
  }
  SetShape(p->mutable_q(), v1::BFLOAT16, {4, 4, 8});
  p->mutable_q()->set_data(RandomBytes(4 * 4 * 8 * 2, rng));
  for (v1::Tensor* t : {p->mutable_k(), p->mutable_v()}) {
    SetShape(t, v1::BFLOAT16, {4, 2, 8});
    t->set_data(RandomBytes(4 * 2 * 8 * 2, rng));
  }
  return request;
}

TEST(AnswerBuffer, BuildDecodeStepPutsTheAnswersOutputsInTheBuffer) {
  std::mt19937 rng(7);
  std::unique_ptr<PinnedPool> pool = Pool(size_t{1} << 20, true);
  const v1::DecodeStepRequest request = PackedStep(/*return_lse=*/true, &rng);
  v1::DecodeStepResponse response;
  AnswerPlace answer{pool.get(), nullptr};
  auto call = BuildDecodeStep(request, 8, /*shm=*/nullptr, &response, &answer);
  ASSERT_TRUE(call.ok()) << call.status();
  ASSERT_NE(answer.buffer, nullptr);
  ASSERT_EQ((*call)->out.size(), 3u);
  ASSERT_EQ((*call)->lse.size(), 3u);
  std::vector<std::string> written;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ((*call)->out_at[i], kvcache::BytesAt::kPageLocked);
    EXPECT_EQ((*call)->lse_at[i], kvcache::BytesAt::kPageLocked);
    EXPECT_TRUE(response.results(int(i)).out().data().empty()) << "not sized in the message";
    const size_t out_bytes = size_t((*call)->items[i].q.rows * 4 * 8 * 2);
    if (i > 0) {  // back to back in item order: the store's in-place output path applies
      EXPECT_EQ(static_cast<char*>((*call)->out[i]),
                static_cast<char*>((*call)->out[i - 1]) + (*call)->items[i - 1].q.rows * 4 * 8 * 2);
    }
    written.push_back(RandomBytes(out_bytes, &rng));  // as the store would write O
    std::copy(written.back().begin(), written.back().end(), static_cast<char*>((*call)->out[i]));
  }
  const AnswerPieces pieces = EncodeDecodeStepAnswer(&response, answer.buffer.get());
  v1::DecodeStepResponse parsed;
  ASSERT_TRUE(parsed.ParseFromString(Concatenate(pieces, answer.buffer.get())));
  ASSERT_EQ(parsed.results_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(parsed.results(i).out().data(), written[size_t(i)]);
    EXPECT_EQ(parsed.results(i).lse().data().size(),
              size_t((*call)->items[size_t(i)].q.rows * 4 * 4));
  }
}

TEST(AnswerBuffer, WithoutRoomTheOutputsGoIntoTheMessage) {
  std::mt19937 rng(8);
  std::unique_ptr<PinnedPool> full = Pool(0, true);
  const v1::DecodeStepRequest request = PackedStep(/*return_lse=*/false, &rng);
  v1::DecodeStepResponse response;
  AnswerPlace answer{full.get(), nullptr};
  auto call = BuildDecodeStep(request, 8, /*shm=*/nullptr, &response, &answer);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(answer.buffer, nullptr);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(response.results(i).out().data().size(),
              size_t((*call)->items[size_t(i)].q.rows * 4 * 8 * 2));
    EXPECT_EQ((*call)->out[size_t(i)], response.results(i).out().data().data());
    EXPECT_FALSE(response.results(i).has_lse());
  }
  EXPECT_TRUE((*call)->out_at.empty()) << "all in host memory (the message)";
}

// PackedStep with packed.answer_packed into `request` (the call's rows point into it), built
// against `answer`.
absl::StatusOr<std::shared_ptr<DecodeCall>> BuildPackedAnswerStep(bool return_lse,
                                                                  std::mt19937* rng,
                                                                  v1::DecodeStepRequest* request,
                                                                  v1::DecodeStepResponse* response,
                                                                  AnswerPlace* answer) {
  *request = PackedStep(return_lse, rng);
  request->mutable_packed()->set_answer_packed(true);
  return BuildDecodeStep(*request, 8, /*shm=*/nullptr, response, answer);
}

// packed.answer_packed: the step's O and LSE are one tensor each in response.packed, every item's
// place its slice in item order; the results carry only their lengths. In the buffer when the
// pool has room, else in the message; the pieces parse back to the message with the data in.
TEST(AnswerBuffer, APackedAnswerIsOneTensorEachSlicedInItemOrder) {
  for (const bool room : {true, false}) {
    SCOPED_TRACE(room ? "in the buffer" : "in the message");
    std::mt19937 rng(9);
    std::unique_ptr<PinnedPool> pool = Pool(room ? size_t{1} << 20 : 0, true);
    v1::DecodeStepRequest request;
    v1::DecodeStepResponse response;
    AnswerPlace answer{pool.get(), nullptr};
    auto call = BuildPackedAnswerStep(/*return_lse=*/true, &rng, &request, &response, &answer);
    ASSERT_TRUE(call.ok()) << call.status();
    EXPECT_EQ(answer.buffer != nullptr, room);
    const v1::PackedDecodeAnswer& packed = response.packed();
    EXPECT_EQ(packed.out().dtype(), v1::BFLOAT16);
    EXPECT_EQ(std::vector<int64_t>(packed.out().shape().begin(), packed.out().shape().end()),
              (std::vector<int64_t>{4, 4, 8}))
        << "like packed.q: rows 1 + 2 + 1";
    EXPECT_EQ(packed.lse().dtype(), v1::FLOAT32);
    ASSERT_EQ(packed.lse().shape_size(), 1);
    EXPECT_EQ(packed.lse().shape(0), 4 * 4) << "each item's [heads, rows] back to back";
    ASSERT_EQ((*call)->out.size(), 3u);
    std::string out_written, lse_written;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_FALSE(response.results(int(i)).has_out());
      EXPECT_FALSE(response.results(int(i)).has_lse());
      const kvcache::HostRows& q = (*call)->items[i].q;
      const std::string out = RandomBytes(size_t(q.rows * 4 * 8 * 2), &rng);  // as the store writes
      const std::string lse = RandomBytes(size_t(q.rows * 4 * 4), &rng);
      std::copy(out.begin(), out.end(), static_cast<char*>((*call)->out[i]));
      std::copy(lse.begin(), lse.end(), reinterpret_cast<char*>((*call)->lse[i]));
      out_written += out;
      lse_written += lse;
      const kvcache::BytesAt at = room ? kvcache::BytesAt::kPageLocked : kvcache::BytesAt::kHost;
      EXPECT_EQ(i < (*call)->out_at.size() ? (*call)->out_at[i] : kvcache::BytesAt::kHost, at);
    }
    const AnswerPieces pieces = EncodeDecodeStepAnswer(&response, answer.buffer.get());
    const std::string wire = Concatenate(pieces, answer.buffer.get());
    v1::DecodeStepResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(wire));
    if (room) {
      EXPECT_EQ(wire[0], char(5 << 3 | 2)) << "the packed answer first (field 5)";
    }
    EXPECT_EQ(parsed.results_size(), 3);
    EXPECT_EQ(parsed.packed().out().data(), out_written);
    EXPECT_EQ(parsed.packed().lse().data(), lse_written);
    EXPECT_EQ(parsed.packed().out().shape_size(), 3);
  }
}

// A region for O leaves only the LSE packed in the answer; without return_lse no LSE tensor.
TEST(AnswerBuffer, APackedAnswerCarriesOnlyWhatTravelsInIt) {
  std::mt19937 rng(10);
  std::unique_ptr<PinnedPool> pool = Pool(size_t{1} << 20, true);
  v1::DecodeStepRequest request;
  v1::DecodeStepResponse response;
  AnswerPlace answer{pool.get(), nullptr};
  auto call = BuildPackedAnswerStep(/*return_lse=*/false, &rng, &request, &response, &answer);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_TRUE(response.packed().has_out());
  EXPECT_FALSE(response.packed().has_lse());
  EXPECT_TRUE((*call)->lse.empty());
}

}  // namespace
}  // namespace flashserve
