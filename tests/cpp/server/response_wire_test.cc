// EncodeAttentionResponse (server/api/response_wire.h): out_prefix + out + lse_prefix + lse + rest
// must parse to the header with the tensors' data filled in. Random headers use a fresh seed per
// run, printed on failure; FLASHSERVE_TEST_SEED=<seed> replays one.
#include "api/response_wire.h"

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using google::protobuf::util::MessageDifferencer;

uint64_t Seed() {
  if (const char* s = std::getenv("FLASHSERVE_TEST_SEED")) return std::strtoull(s, nullptr, 0);
  std::random_device device;
  return (uint64_t(device()) << 32) ^ device();
}

std::string Bytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

std::string Utf8(std::mt19937_64& rng) {
  static const std::vector<std::string> kPieces = {"a", "_", "9", "\xc3\xa9", "\xe2\x82\xac",
                                                   "\xf0\x9f\x98\x80", std::string(1, '\0')};
  std::string s;
  for (int n = int(rng() % 20); n > 0; --n) s += kPieces[rng() % kPieces.size()];
  return s;
}

// Sizes around the points where a length varint grows a byte (128, 16384, 2097152).
size_t DataSize(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: case 1: return 0;
    case 2: return 1 + rng() % 8;
    case 3: return 100 + rng() % 60;
    case 4: return 16300 + rng() % 150;
    case 5: return rng() % 70000;
    case 6: return rng() % 1000;
    default: return rng() % 100 == 0 ? 2097100 + rng() % 100 : rng() % 300;
  }
}

void RandomTensorHeader(v1::Tensor* t, std::mt19937_64& rng) {
  static const int kDTypes[] = {0, 1, 2, 3, 9, -2};
  t->set_dtype(static_cast<v1::DType>(kDTypes[rng() % 6]));
  for (int n = int(rng() % 6); n > 0; --n) {
    t->add_shape(rng() % 5 == 0 ? int64_t(rng()) : int64_t(rng() % 4097));
  }
  // The header's data is ignored (response_wire.h); something there must not leak through.
  if (rng() % 4 == 0) t->set_data(Bytes(rng, rng() % 40));
}

v1::AttentionResponse RandomHeader(std::mt19937_64& rng) {
  v1::AttentionResponse h;
  if (rng() % 8 != 0) RandomTensorHeader(h.mutable_out(), rng);
  if (rng() % 2 == 0) RandomTensorHeader(h.mutable_lse(), rng);
  if (rng() % 6 != 0) {
    v1::Timing* t = h.mutable_timing();
    auto value = [&] { return rng() % 7 == 0 ? int64_t(rng()) : int64_t(rng() % 1000000); };
    t->set_queue_us(value());
    t->set_h2d_us(value());
    t->set_compute_us(value());
    t->set_d2h_us(value());
    t->set_total_us(value());
    t->set_stage_us(value());
  }
  if (rng() % 5 != 0) h.set_kernel(Utf8(rng));
  if (rng() % 3 != 0) h.set_request_id(Utf8(rng));
  return h;
}

// What the pieces must parse to: the header, its out data replaced by `out`, and its lse data by
// `lse` where there is an lse (non-empty bytes, or the header has one).
v1::AttentionResponse Expected(const v1::AttentionResponse& header, std::string_view out,
                               std::string_view lse) {
  v1::AttentionResponse expected = header;
  expected.mutable_out()->set_data(std::string(out));
  if (!lse.empty() || header.has_lse()) expected.mutable_lse()->set_data(std::string(lse));
  return expected;
}

// Encodes, checks the pieces and what they parse to; returns the parsed message.
v1::AttentionResponse ExpectRoundTrip(const v1::AttentionResponse& header, std::string_view out,
                                      std::string_view lse) {
  const ResponsePieces pieces = EncodeAttentionResponse(header, out, lse);
  std::string wire = pieces.out_prefix;
  wire.append(out);
  wire += pieces.lse_prefix;
  wire.append(lse);
  wire += pieces.rest;
  v1::AttentionResponse parsed;
  EXPECT_TRUE(parsed.ParseFromString(wire));
  const v1::AttentionResponse expected = Expected(header, out, lse);
  EXPECT_TRUE(MessageDifferencer::Equals(parsed, expected))
      << "out " << out.size() << " bytes, lse " << lse.size() << " bytes\nheader: "
      << header.ShortDebugString().substr(0, 2000);
  // With out data (every response the server sends), or with neither tensor's data, the bytes are
  // exactly protobuf's own serialization of that message. (Empty out but lse data: out's dtype and
  // shape come in `rest`, after lse, which parses the same.)
  if (!out.empty() || lse.empty()) {
    EXPECT_TRUE(wire == expected.SerializeAsString());
  }

  EXPECT_EQ(pieces.out_prefix.empty(), out.empty());
  EXPECT_EQ(pieces.lse_prefix.empty(), lse.empty());
  v1::AttentionResponse rest;
  EXPECT_TRUE(rest.ParseFromString(pieces.rest));
  if (!out.empty()) {
    EXPECT_FALSE(rest.has_out());  // out came in out_prefix, and only there
  }
  if (!lse.empty()) {
    EXPECT_FALSE(rest.has_lse());
  }
  EXPECT_TRUE(rest.out().data().empty());
  EXPECT_TRUE(rest.lse().data().empty());
  return parsed;
}

TEST(ResponseWire, RandomHeadersRoundTrip) {
  const uint64_t seed = Seed();
  SCOPED_TRACE("FLASHSERVE_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 600; ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const v1::AttentionResponse header = RandomHeader(rng);
    const std::string out = Bytes(rng, DataSize(rng));
    const std::string lse = Bytes(rng, DataSize(rng));
    ExpectRoundTrip(header, out, lse);
    if (HasFailure()) return;
  }
}

v1::AttentionResponse SampleHeader(bool with_lse) {
  v1::AttentionResponse h;
  h.mutable_out()->set_dtype(v1::BFLOAT16);
  for (int64_t d : {2, 3, 4, 8}) h.mutable_out()->add_shape(d);
  if (with_lse) {
    h.mutable_lse()->set_dtype(v1::FLOAT32);
    for (int64_t d : {2, 4, 3}) h.mutable_lse()->add_shape(d);
  }
  v1::Timing* t = h.mutable_timing();
  t->set_queue_us(1);
  t->set_h2d_us(2);
  t->set_compute_us(3);
  t->set_d2h_us(4);
  t->set_total_us(15);
  t->set_stage_us(5);
  h.set_kernel("cpu/tiled");
  h.set_request_id("req-\xe2\x82\xac");
  return h;
}

TEST(ResponseWire, OutAndLse) {
  const std::string out(2 * 3 * 4 * 8 * 2, 'o'), lse(2 * 4 * 3 * 4, 'l');
  const v1::AttentionResponse parsed = ExpectRoundTrip(SampleHeader(true), out, lse);
  EXPECT_EQ(parsed.out().data(), out);
  EXPECT_EQ(parsed.lse().data(), lse);
  EXPECT_EQ(parsed.lse().shape_size(), 3);
  EXPECT_EQ(parsed.timing().stage_us(), 5);
}

TEST(ResponseWire, NoLseInTheHeaderAndNoLseBytes) {
  const v1::AttentionResponse parsed = ExpectRoundTrip(SampleHeader(false), "out bytes", "");
  EXPECT_FALSE(parsed.has_lse());
  EXPECT_TRUE(EncodeAttentionResponse(SampleHeader(false), "out bytes", "").lse_prefix.empty());
}

TEST(ResponseWire, LseInTheHeaderButNoLseBytes) {
  v1::AttentionResponse header = SampleHeader(true);
  header.mutable_lse()->set_data("stale");  // ignored
  const v1::AttentionResponse parsed = ExpectRoundTrip(header, "out bytes", "");
  ASSERT_TRUE(parsed.has_lse());
  EXPECT_EQ(parsed.lse().dtype(), v1::FLOAT32);
  EXPECT_EQ(parsed.lse().shape_size(), 3);
  EXPECT_TRUE(parsed.lse().data().empty());
}

TEST(ResponseWire, LseBytesWithoutLseInTheHeader) {
  const v1::AttentionResponse parsed = ExpectRoundTrip(SampleHeader(false), "out", "lse!");
  ASSERT_TRUE(parsed.has_lse());
  EXPECT_EQ(parsed.lse().dtype(), v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(parsed.lse().data(), "lse!");
}

TEST(ResponseWire, EmptyOut) {
  for (bool with_lse : {false, true}) {
    SCOPED_TRACE(with_lse ? "with lse" : "without lse");
    v1::AttentionResponse header = SampleHeader(with_lse);
    header.mutable_out()->set_data("stale");  // ignored
    const ResponsePieces pieces = EncodeAttentionResponse(header, "", with_lse ? "lse" : "");
    EXPECT_TRUE(pieces.out_prefix.empty());
    const v1::AttentionResponse parsed = ExpectRoundTrip(header, "", with_lse ? "lse" : "");
    EXPECT_EQ(parsed.out().shape_size(), 4);
    EXPECT_TRUE(parsed.out().data().empty());
  }
}

TEST(ResponseWire, EmptyHeader) {
  ExpectRoundTrip(v1::AttentionResponse(), "", "");
  ExpectRoundTrip(v1::AttentionResponse(), "x", "");
  ExpectRoundTrip(v1::AttentionResponse(), "", "y");
  ExpectRoundTrip(v1::AttentionResponse(), "x", "y");
}

TEST(ResponseWire, LengthsWhereTheVarintGrows) {
  const v1::AttentionResponse header = SampleHeader(true);
  for (size_t n : {127u, 128u, 16383u, 16384u, 2097151u, 2097152u}) {
    SCOPED_TRACE(n);
    const std::string bytes(n, '\x5a');
    ExpectRoundTrip(header, bytes, "");
    ExpectRoundTrip(header, "o", bytes);
  }
}

}  // namespace
}  // namespace flashserve
