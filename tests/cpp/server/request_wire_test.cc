// ParseAttentionRequestWire (server/api/request_wire.h) against protobuf's own parser: random valid
// requests split anywhere, protobuf's merge semantics for a repeated q/k/v, and malformed input.
// The random tests use a fresh seed per run, printed on failure; FLASHSERVE_TEST_SEED=<seed>
// replays one.
#include "api/request_wire.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

using google::protobuf::util::MessageDifferencer;

uint64_t TestSeed() {
  if (const char* s = std::getenv("FLASHSERVE_TEST_SEED")) return std::strtoull(s, nullptr, 0);
  std::random_device device;
  return (uint64_t(device()) << 32) ^ device();
}

// The serialized request as separately allocated slices (ASan sees a read past one), empty ones
// included: a default string_view (nullptr) or a zero-length view of a live allocation.
struct Slices {
  std::vector<std::unique_ptr<char[]>> storage;
  std::vector<std::string_view> views;

  void Add(std::string_view bytes, bool null_if_empty = true) {
    if (bytes.empty() && null_if_empty) {
      views.emplace_back();
      return;
    }
    storage.push_back(std::make_unique<char[]>(std::max<size_t>(bytes.size(), 1)));
    std::copy(bytes.begin(), bytes.end(), storage.back().get());
    views.emplace_back(storage.back().get(), bytes.size());
  }
};

Slices OneSlice(std::string_view wire) {
  Slices s;
  s.Add(wire);
  return s;
}

Slices ByteSlices(std::string_view wire) {
  Slices s;
  for (char c : wire) s.Add(std::string_view(&c, 1));
  return s;
}

// `wire` cut at random points: one slice, one byte per slice, or 1..16 cuts (a repeated cut point
// gives an empty slice); sometimes with empty slices at the ends.
Slices RandomSplit(std::string_view wire, std::mt19937_64& rng) {
  const int mode = int(rng() % 6);
  if (mode == 0) return OneSlice(wire);
  if (mode == 1 && wire.size() <= 4096) return ByteSlices(wire);
  std::vector<size_t> cuts(1 + rng() % 16);
  for (size_t& c : cuts) c = rng() % (wire.size() + 1);
  std::sort(cuts.begin(), cuts.end());
  Slices s;
  if (rng() % 4 == 0) s.Add({}, rng() % 2 == 0);
  size_t begin = 0;
  for (size_t c : cuts) {
    s.Add(wire.substr(begin, c - begin), rng() % 2 == 0);
    begin = c;
  }
  s.Add(wire.substr(begin), rng() % 2 == 0);
  if (rng() % 4 == 0) s.Add({}, rng() % 2 == 0);
  return s;
}

std::string Describe(const Slices& slices) {
  std::string out = std::to_string(slices.views.size()) + " slices:";
  for (size_t i = 0; i < slices.views.size() && i < 40; ++i) {
    out += " " + std::to_string(slices.views[i].size());
  }
  if (slices.views.size() > 40) out += " ...";
  return out;
}

// Field by field (a NaN softmax_scale equals itself) and byte for byte (same NaN bits, same
// unknown fields in the same order).
bool Same(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  MessageDifferencer differencer;
  differencer.set_field_comparator(&comparator);
  return differencer.Compare(a, b) && a.SerializeAsString() == b.SerializeAsString();
}

void ExpectMalformed(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_TRUE(absl::StartsWith(status.message(), "flashserve.v1.AttentionRequest:")) << status;
}

// `spans` locate exactly `data`, every piece inside one of the slices (no copy was made).
void ExpectSpans(const TensorSpans& spans, const std::string& data, const Slices& slices,
                 const char* name) {
  SCOPED_TRACE(name);
  EXPECT_EQ(spans.bytes, int64_t(data.size()));
  int64_t sum = 0;
  for (std::string_view piece : spans.pieces) {
    sum += int64_t(piece.size());
    if (piece.empty()) continue;
    const auto begin = reinterpret_cast<uintptr_t>(piece.data());
    const bool inside = std::any_of(slices.views.begin(), slices.views.end(), [&](auto s) {
      const auto s_begin = reinterpret_cast<uintptr_t>(s.data());
      return begin >= s_begin && begin + piece.size() <= s_begin + s.size();
    });
    EXPECT_TRUE(inside) << "a piece of " << piece.size() << " bytes is not inside any slice";
  }
  EXPECT_EQ(sum, spans.bytes);
  if (spans.bytes != int64_t(data.size()) || sum != spans.bytes) return;
  std::string copy(data.size(), '\xAA');
  spans.CopyTo(copy.data());
  if (copy != data) {
    const size_t at = size_t(std::mismatch(copy.begin(), copy.end(), data.begin()).first -
                             copy.begin());
    ADD_FAILURE() << "CopyTo differs from the data (" << data.size() << " bytes) at byte " << at;
  }
}

// ParseAttentionRequestWire(slices) must do what ParseFromString(wire) does: fail alike, or give
// the same message, its tensors' data located by the spans. Returns whether protobuf parsed it.
bool ExpectMatchesProtobuf(const std::string& wire, const Slices& slices) {
  SCOPED_TRACE(Describe(slices));
  v1::AttentionRequest expected;
  const bool protobuf_ok = expected.ParseFromString(wire);
  WireRequest got;
  const absl::Status status = ParseAttentionRequestWire(slices.views, &got);
  EXPECT_EQ(status.ok(), protobuf_ok) << status;
  if (!status.ok()) {
    ExpectMalformed(status);
    return protobuf_ok;
  }
  if (!protobuf_ok) return false;
  ExpectSpans(got.data[0], expected.q().data(), slices, "q");
  ExpectSpans(got.data[1], expected.k().data(), slices, "k");
  ExpectSpans(got.data[2], expected.v().data(), slices, "v");
  if (expected.has_q()) expected.mutable_q()->clear_data();
  if (expected.has_k()) expected.mutable_k()->clear_data();
  if (expected.has_v()) expected.mutable_v()->clear_data();
  EXPECT_TRUE(Same(got.header, expected)) << "ours:     " << got.header.ShortDebugString()
                                          << "\nprotobuf: " << expected.ShortDebugString();
  return true;
}

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

std::string RandomUtf8(std::mt19937_64& rng) {
  static const std::vector<std::string> kPieces = {
      "a", "Z", "0", "-", " ", "\x7f", std::string(1, '\0'), "\xc3\xa9", "\xe2\x82\xac",
      "\xf0\x9f\x98\x80"};
  std::string s;
  const int n = int(rng() % 12);
  for (int i = 0; i < n; ++i) s += kPieces[rng() % kPieces.size()];
  return s;
}

// Unknown fields under numbers past the message's last field (read from its descriptor, so a
// field added to the proto never collides); varint and fixed ones also under the message's own
// numbers (q/k/v as a varint stays unknown to protobuf too; causal as a varint is simply causal).
void AddUnknownFields(google::protobuf::Message* m, std::mt19937_64& rng) {
  const google::protobuf::Descriptor* descriptor = m->GetDescriptor();
  int last_field = 0;
  for (int i = 0; i < descriptor->field_count(); ++i) {
    last_field = std::max(last_field, descriptor->field(i)->number());
  }
  google::protobuf::UnknownFieldSet* set = m->GetReflection()->MutableUnknownFields(m);
  const int n = 1 + int(rng() % 3);
  for (int i = 0; i < n; ++i) {
    const int unused = last_field + 1 + int(rng() % 3000);
    const int own = descriptor->field(int(rng() % descriptor->field_count()))->number();
    const int any = rng() % 2 == 0 ? unused : own;
    switch (rng() % 4) {
      case 0: set->AddVarint(any, rng() >> (rng() % 64)); break;
      case 1: set->AddFixed32(any, uint32_t(rng())); break;
      case 2: set->AddFixed64(any, rng()); break;
      default: set->AddLengthDelimited(unused, RandomBytes(rng, rng() % 20)); break;
    }
  }
}

// A shared-memory reference as a client writes one (the parser passes it through unchecked).
void RandomShmRef(v1::SharedMemoryRef* ref, std::mt19937_64& rng) {
  ref->set_region(RandomUtf8(rng));
  if (rng() % 2 == 0) ref->set_offset(rng() >> (rng() % 64));
  if (rng() % 2 == 0) ref->set_byte_size(rng() >> (rng() % 64));
}

size_t RandomDataSize(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: case 1: return 0;
    case 2: return 1;
    case 3: return 120 + rng() % 20;  // the length varint goes from 1 to 2 bytes at 128
    case 4: return rng() % 64;
    case 5: return rng() % 5000;
    case 6: return 16380 + rng() % 10;  // 2 to 3 bytes at 16384
    default: return rng() % 40000;
  }
}

void RandomTensor(v1::Tensor* t, std::mt19937_64& rng, bool unknown_fields) {
  static const int kDTypes[] = {0, 1, 2, 3, 7, -1};
  t->set_dtype(static_cast<v1::DType>(kDTypes[rng() % 6]));
  const int rank = int(rng() % 6);
  for (int i = 0; i < rank; ++i) {
    switch (rng() % 6) {
      case 0: t->add_shape(0); break;
      case 1: t->add_shape(-int64_t(rng() % 100)); break;
      case 2: t->add_shape(int64_t(rng() >> 1)); break;
      default: t->add_shape(1 + int64_t(rng() % 16)); break;
    }
  }
  if (rng() % 8 == 0) t->clear_dtype();
  t->set_data(RandomBytes(rng, RandomDataSize(rng)));
  if (rng() % 8 == 0) RandomShmRef(t->mutable_shm(), rng);
  if (unknown_fields) AddUnknownFields(t, rng);
}

v1::AttentionRequest RandomRequest(std::mt19937_64& rng) {
  v1::AttentionRequest r;
  const bool unknown = rng() % 4 == 0;
  if (rng() % 10 != 0) RandomTensor(r.mutable_q(), rng, unknown && rng() % 2 == 0);
  if (rng() % 10 != 0) RandomTensor(r.mutable_k(), rng, unknown && rng() % 2 == 0);
  if (rng() % 10 != 0) RandomTensor(r.mutable_v(), rng, unknown && rng() % 2 == 0);
  if (rng() % 10 == 0) r.mutable_q();  // present but empty
  r.set_causal(rng() % 2 == 0);
  if (rng() % 2 == 0) {
    static const float kScales[] = {0.f, 0.125f, -1.f, 3e38f, 1e-40f, -0.f,
                                    std::numeric_limits<float>::quiet_NaN(),
                                    std::numeric_limits<float>::infinity()};
    r.set_softmax_scale(kScales[rng() % 8]);  // set, even to 0: proto3 optional keeps presence
  }
  r.set_return_lse(rng() % 2 == 0);
  if (rng() % 2 == 0) r.set_request_id(RandomUtf8(rng));
  if (rng() % 8 == 0) RandomShmRef(r.mutable_out_shm(), rng);
  if (rng() % 8 == 0) RandomShmRef(r.mutable_lse_shm(), rng);
  if (unknown) AddUnknownFields(&r, rng);
  return r;
}

// Bytes of a random valid request; sometimes two or three serialized requests concatenated (a
// valid message too: protobuf merges them), sometimes fields in an unusual order.
std::string RandomWire(std::mt19937_64& rng) {
  std::string wire = RandomRequest(rng).SerializeAsString();
  switch (rng() % 8) {
    case 0: wire += RandomRequest(rng).SerializeAsString(); break;
    case 1:
      wire += RandomRequest(rng).SerializeAsString();
      wire += RandomRequest(rng).SerializeAsString();
      break;
    case 2: {  // an empty q first, then the request, then q again: data only, then dtype and shape
      const v1::AttentionRequest r = RandomRequest(rng);
      v1::Tensor data_only;
      data_only.set_data(RandomBytes(rng, rng() % 100));
      const std::string q = data_only.SerializeAsString() + r.q().SerializeAsString();
      wire = std::string("\x0a\x00", 2) + r.SerializeAsString();
      if (q.size() < 128) wire += "\x0a" + std::string(1, char(q.size())) + q;
      break;
    }
    default: break;
  }
  return wire;
}

TEST(RequestWire, RandomRequestsSplitAnywhereMatchProtobuf) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE("FLASHSERVE_TEST_SEED=" + std::to_string(seed));
  std::mt19937_64 rng(seed);
  int with_data = 0;
  for (int i = 0; i < 1500; ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const std::string wire = RandomWire(rng);
    for (int split = 0; split < 3; ++split) {
      const bool ok = ExpectMatchesProtobuf(wire, RandomSplit(wire, rng));
      ASSERT_TRUE(ok) << "protobuf refused a request the test built";
      if (HasFailure()) return;  // one case is enough to read
    }
    v1::AttentionRequest r;
    ASSERT_TRUE(r.ParseFromString(wire));
    with_data += !r.q().data().empty() && !r.k().data().empty();
  }
  EXPECT_GT(with_data, 100);  // the generator does cover tensors with data
}

TEST(RequestWire, OneSliceAndByteSlices) {
  std::mt19937_64 rng(1);
  v1::AttentionRequest r = RandomRequest(rng);
  r.mutable_q()->set_data(std::string(300, 'q'));
  r.mutable_k()->set_data("k");
  r.mutable_v()->set_data(std::string(70000, 'v'));
  r.set_request_id("id-\xe2\x82\xac");
  const std::string wire = r.SerializeAsString();
  ExpectMatchesProtobuf(wire, OneSlice(wire));
  ExpectMatchesProtobuf(wire, ByteSlices(wire));
  WireRequest got;
  const Slices bytes = ByteSlices(wire);
  ASSERT_TRUE(ParseAttentionRequestWire(bytes.views, &got).ok());
  EXPECT_EQ(got.data[0].pieces.size(), 300u);  // one piece per slice
  EXPECT_EQ(got.data[2].bytes, 70000);
}

// --- protobuf's merge semantics for a repeated q/k/v --------------------------------------------

v1::Tensor MakeTensor(v1::DType dtype, std::vector<int64_t> shape, std::string data) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::move(data));
  return t;
}

void ExpectAllSplitsMatch(const std::string& wire) {
  std::mt19937_64 rng(TestSeed());
  ExpectMatchesProtobuf(wire, OneSlice(wire));
  ExpectMatchesProtobuf(wire, ByteSlices(wire));
  for (int i = 0; i < 20; ++i) ExpectMatchesProtobuf(wire, RandomSplit(wire, rng));
}

TEST(RequestWire, RepeatedTensorMergesAndLastDataWins) {
  v1::AttentionRequest first, second;
  *first.mutable_q() = MakeTensor(v1::FLOAT16, {1, 2}, "first q data");
  *first.mutable_k() = MakeTensor(v1::FLOAT16, {1, 2}, "first k");
  *second.mutable_q() = MakeTensor(v1::FLOAT32, {3, 4}, "second");
  second.set_request_id("r2");
  const std::string wire = first.SerializeAsString() + second.SerializeAsString();
  ExpectAllSplitsMatch(wire);

  WireRequest got;
  const Slices slices = ByteSlices(wire);
  ASSERT_TRUE(ParseAttentionRequestWire(slices.views, &got).ok());
  EXPECT_EQ(got.header.q().dtype(), v1::FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(got.header.q().shape().begin(), got.header.q().shape().end()),
            (std::vector<int64_t>{1, 2, 3, 4}));
  EXPECT_TRUE(got.header.q().data().empty());
  std::string q(size_t(got.data[0].bytes), '\0');
  got.data[0].CopyTo(q.data());
  EXPECT_EQ(q, "second");
  std::string k(size_t(got.data[1].bytes), '\0');
  got.data[1].CopyTo(k.data());
  EXPECT_EQ(k, "first k");
  EXPECT_EQ(got.header.request_id(), "r2");
}

TEST(RequestWire, SecondOccurrenceWithoutDataKeepsTheFirstData) {
  v1::AttentionRequest first, second;
  *first.mutable_v() = MakeTensor(v1::BFLOAT16, {2}, "vvvv");
  second.mutable_v()->add_shape(9);  // no data field on the wire
  const std::string wire = first.SerializeAsString() + second.SerializeAsString();
  ExpectAllSplitsMatch(wire);
  WireRequest got;
  const Slices slices = OneSlice(wire);
  ASSERT_TRUE(ParseAttentionRequestWire(slices.views, &got).ok());
  EXPECT_EQ(got.header.v().shape_size(), 2);
  EXPECT_EQ(got.data[2].bytes, 4);
  std::string v(4, '\0');
  got.data[2].CopyTo(v.data());
  EXPECT_EQ(v, "vvvv");
}

TEST(RequestWire, ExplicitEmptyDataReplacesEarlierData) {
  v1::AttentionRequest first;
  *first.mutable_q() = MakeTensor(v1::FLOAT32, {1}, "abcd");
  // q { data: "" } written out, which a serializer leaves out; then data twice inside one q.
  const std::string wire = first.SerializeAsString() + std::string("\x0a\x02\x1a\x00", 4) +
                           std::string("\x0a\x08\x1a\x02xy\x1a\x02zw", 10);
  ExpectAllSplitsMatch(wire);
  const std::string cleared = first.SerializeAsString() + std::string("\x0a\x02\x1a\x00", 4);
  ExpectAllSplitsMatch(cleared);
  WireRequest got;
  Slices slices = OneSlice(cleared);
  ASSERT_TRUE(ParseAttentionRequestWire(slices.views, &got).ok());
  EXPECT_EQ(got.data[0].bytes, 0);
}

TEST(RequestWire, ReusedOutputStartsFresh) {
  v1::AttentionRequest with_data;
  *with_data.mutable_q() = MakeTensor(v1::FLOAT32, {1}, "abcd");
  *with_data.mutable_k() = MakeTensor(v1::FLOAT32, {1}, "efgh");
  v1::AttentionRequest without;
  without.set_causal(true);
  const std::string a = with_data.SerializeAsString(), b = without.SerializeAsString();
  WireRequest got;
  ASSERT_TRUE(ParseAttentionRequestWire({a}, &got).ok());
  ASSERT_TRUE(ParseAttentionRequestWire({b}, &got).ok());
  EXPECT_FALSE(got.header.has_q());
  EXPECT_TRUE(got.header.causal());
  for (const TensorSpans& spans : got.data) {
    EXPECT_EQ(spans.bytes, 0);
    EXPECT_TRUE(spans.pieces.empty());
  }
}

// --- malformed input --------------------------------------------------------------------------

// A small request with every field set; each of its prefixes parses exactly as protobuf parses
// it (some prefixes are valid messages themselves) or is refused, never read past.
TEST(RequestWire, EveryPrefixOfARequestMatchesProtobuf) {
  v1::AttentionRequest r;
  *r.mutable_q() = MakeTensor(v1::FLOAT16, {1, 2, 1, 2}, "01234567");
  *r.mutable_k() = MakeTensor(v1::FLOAT16, {1, 1, 1, 2}, "abcd");
  *r.mutable_v() = MakeTensor(v1::FLOAT16, {1, 1, 1, 2}, "wxyz");
  r.set_causal(true);
  r.set_softmax_scale(0.5f);
  r.set_return_lse(true);
  r.set_request_id("pr\xc3\xa9" "fix");
  r.GetReflection()->MutableUnknownFields(&r)->AddFixed64(99, 42);
  const std::string wire = r.SerializeAsString();
  std::mt19937_64 rng(TestSeed());
  int refused = 0, parsed = 0;
  for (size_t n = 0; n <= wire.size(); ++n) {
    SCOPED_TRACE("prefix of " + std::to_string(n) + " bytes");
    const std::string prefix = wire.substr(0, n);
    const bool ok = ExpectMatchesProtobuf(prefix, OneSlice(prefix));
    ExpectMatchesProtobuf(prefix, ByteSlices(prefix));
    ExpectMatchesProtobuf(prefix, RandomSplit(prefix, rng));
    (ok ? parsed : refused) += 1;
  }
  EXPECT_GT(refused, 20);
  EXPECT_GE(parsed, 8);  // the empty prefix and one per complete top-level field
}

struct MalformedCase {
  const char* name;
  std::string wire;
};

std::string B(std::initializer_list<int> bytes) {
  std::string s;
  for (int b : bytes) s.push_back(char(b));
  return s;
}

// Each is refused by protobuf as well (checked), as INVALID_ARGUMENT
// "flashserve.v1.AttentionRequest: ...".
TEST(RequestWire, MalformedInputIsRefused) {
  const std::string valid_q = MakeTensor(v1::FLOAT32, {1}, "abcd").SerializeAsString();
  const std::vector<MalformedCase> cases = {
      {"request_id length past the end", B({0x3a, 0x05}) + "abc"},
      {"unknown field length past the end", B({0x52, 0x7f, 0x00})},
      {"q length past the end", B({0x0a, 0x05, 0x08, 0x01})},
      {"q length past the end, huge", B({0x0a, 0xff, 0xff, 0xff, 0xff, 0x07, 0x08, 0x01})},
      {"q.data length past q's end, inside the input",
       B({0x0a, 0x03, 0x1a, 0x05}) + "x" + B({0x20, 0x01, 0x30, 0x01, 0x38})},
      {"q.data length past the end", B({0x0a, 0x04, 0x1a, 0x7f, 0x01, 0x02})},
      {"q.shape length past q's end", B({0x0a, 0x02, 0x12, 0x03, 0x01, 0x02, 0x03})},
      {"q.dtype varint runs past q's end", B({0x0a, 0x02, 0x08, 0x80, 0x01})},
      {"valid q, then a tag cut short", valid_q + B({0x80})},
      {"varint of 11 bytes (causal)", B({0x20, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                          0x80, 0x80, 0x00})},
      {"varint of 11 bytes (a length)", B({0x3a, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                           0x80, 0x80, 0x00, 0x61})},
      {"varint of 11 bytes (a tag)", B({0xa0, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                        0x80, 0x00, 0x01})},
      {"varint of 11 bytes (q.dtype)", B({0x0a, 0x0c, 0x08, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                          0x80, 0x80, 0x80, 0x80, 0x00})},
      {"varint cut short", B({0x20, 0x80})},
      {"tag over 32 bits", B({0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00})},
      {"field number 0, varint", B({0x00, 0x01})},
      {"field number 0, length-delimited", B({0x02, 0x00})},
      {"field number 0, fixed32", B({0x05, 0x00, 0x00, 0x00, 0x00})},
      {"field number 0 inside q", B({0x0a, 0x02, 0x00, 0x01})},
      {"end group with no start", B({0x4c})},
      {"end group inside q", B({0x0a, 0x01, 0x4c})},
      {"wire type 6", B({0x4e, 0x00})},
      {"wire type 7", B({0x4f, 0x00})},
      {"wire type 6 inside q", B({0x0a, 0x02, 0x1e, 0x00})},
      {"fixed32 cut short (softmax_scale)", B({0x2d, 0x00, 0x00, 0x80})},
      {"fixed64 cut short", B({0x49, 0x00, 0x00, 0x00, 0x00})},
      {"fixed32 inside q past q's end", B({0x0a, 0x03, 0x25, 0x00, 0x00, 0x00, 0x00})},
      {"request_id invalid UTF-8 (lone byte)", B({0x3a, 0x01, 0xff})},
      {"request_id invalid UTF-8 (bad continuation)", B({0x3a, 0x02, 0xc3, 0x28})},
      {"request_id invalid UTF-8 (surrogate)", B({0x3a, 0x03, 0xed, 0xa0, 0x80})},
      {"request_id invalid UTF-8 (overlong)", B({0x3a, 0x02, 0xc0, 0xaf})},
      {"request_id invalid UTF-8 after a valid q", valid_q + B({0x3a, 0x01, 0x80})},
  };
  const google::protobuf::LogSilencer quiet;  // protobuf logs each invalid UTF-8 string
  std::mt19937_64 rng(TestSeed());
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::AttentionRequest reference;
    EXPECT_FALSE(reference.ParseFromString(c.wire)) << "the case is valid for protobuf";
    std::vector<Slices> splits;
    splits.push_back(OneSlice(c.wire));
    splits.push_back(ByteSlices(c.wire));
    for (int i = 0; i < 5; ++i) splits.push_back(RandomSplit(c.wire, rng));
    for (const Slices& slices : splits) {
      WireRequest got;
      ExpectMalformed(ParseAttentionRequestWire(slices.views, &got));
    }
  }
}

// Groups (wire types 3/4, deprecated, never written by proto3) are refused, unlike protobuf, which
// keeps an unknown group as an unknown field (request_wire.cc: CopyField).
TEST(RequestWire, GroupsAreRefused) {
  const std::string valid_q = MakeTensor(v1::FLOAT32, {1}, "abcd").SerializeAsString();
  const std::vector<MalformedCase> cases = {
      {"empty unknown group", B({0x4b, 0x4c})},
      {"unknown group with a field", B({0x4b, 0x48, 0x01, 0x4c})},
      {"group inside q", B({0x0a, 0x04, 0x4b, 0x48, 0x01, 0x4c})},
      {"group after a valid q", B({0x0a, char(valid_q.size())}) + valid_q + B({0x4b, 0x4c})},
      {"start group never ended", B({0x4b})},
  };
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    WireRequest got;
    ExpectMalformed(ParseAttentionRequestWire({c.wire}, &got));
    const Slices bytes = ByteSlices(c.wire);
    ExpectMalformed(ParseAttentionRequestWire(bytes.views, &got));
  }
}

// The documented differences from protobuf 3.21 (request_wire.h), on varints no serializer
// writes: protobuf reads a tag or a length from at most 5 bytes, keeps the low 32 bits of a 5-byte
// tag and drops the bits of a 10-byte varint past 64; we accept tags and lengths padded to 10
// bytes and refuse the overflowing ones. Pinned both ways, so the header comment stays true.
TEST(RequestWire, NonCanonicalVarintsAreHandledAsDocumented) {
  struct Case {
    const char* name;
    std::string wire;
    bool ours_accepts;
  };
  const std::vector<Case> cases = {
      {"tag padded to 6 bytes", B({0xa0, 0x80, 0x80, 0x80, 0x80, 0x00, 0x01}), true},
      {"length padded to 6 bytes", B({0x3a, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00, 0x61}), true},
      {"q length padded to 6 bytes", B({0x0a, 0x82, 0x80, 0x80, 0x80, 0x80, 0x00, 0x08, 0x01}),
       true},
      {"q.data length padded to 6 bytes",
       B({0x0a, 0x08, 0x1a, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00, 0x61}), true},
      {"5-byte tag over 32 bits", B({0xa0, 0x80, 0x80, 0x80, 0x10, 0x01}), false},
      {"10-byte varint, 10th byte 0x7f",
       B({0x20, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}), false},
      {"10-byte varint in q.dtype",
       B({0x0a, 0x0b, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f}), false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::AttentionRequest protobuf;
    EXPECT_EQ(protobuf.ParseFromString(c.wire), !c.ours_accepts) << "protobuf now agrees";
    WireRequest got;
    const absl::Status status = ParseAttentionRequestWire(OneSlice(c.wire).views, &got);
    if (c.ours_accepts) {
      EXPECT_TRUE(status.ok()) << status;
    } else {
      ExpectMalformed(status);
    }
  }
}

// Padded (non-canonical) varints of up to 5 bytes are accepted by both.
TEST(RequestWire, PaddedVarintsWithinProtobufsLimitsMatch) {
  const std::vector<MalformedCase> cases = {
      {"tag padded to 2 bytes", B({0xa0, 0x00, 0x01})},
      {"tag padded to 5 bytes", B({0xa0, 0x80, 0x80, 0x80, 0x00, 0x01})},
      {"q.data tag padded", B({0x0a, 0x05, 0x9a, 0x80, 0x00, 0x01, 0x61})},
      {"length padded to 5 bytes", B({0x3a, 0x81, 0x80, 0x80, 0x80, 0x00, 0x61})},
      {"q length padded to 5 bytes", B({0x0a, 0x82, 0x80, 0x80, 0x80, 0x00, 0x08, 0x01})},
      {"q.data length padded to 5 bytes",
       B({0x0a, 0x07, 0x1a, 0x81, 0x80, 0x80, 0x80, 0x00, 0x61})},
      {"causal padded to 10 bytes", B({0x20, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                       0x80, 0x00})},
      {"10-byte varint with the 64th bit set", B({0x20, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
                                                  0x80, 0x80, 0x01})},
      {"largest field number", B({0xf8, 0xff, 0xff, 0xff, 0x0f, 0x01})},
  };
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_TRUE(ExpectMatchesProtobuf(c.wire, OneSlice(c.wire)));
    ExpectMatchesProtobuf(c.wire, ByteSlices(c.wire));
  }
}

// --- empty input ------------------------------------------------------------------------------

TEST(RequestWire, NoSlicesIsAnEmptyRequest) {
  for (const std::vector<std::string_view>& slices :
       {std::vector<std::string_view>{}, std::vector<std::string_view>{{}},
        std::vector<std::string_view>{"", "", ""}}) {
    WireRequest got;
    ASSERT_TRUE(ParseAttentionRequestWire(slices, &got).ok());
    EXPECT_TRUE(MessageDifferencer::Equals(got.header, v1::AttentionRequest()));
    EXPECT_EQ(got.header.ByteSizeLong(), 0u);
    for (const TensorSpans& spans : got.data) {
      EXPECT_EQ(spans.bytes, 0);
      EXPECT_TRUE(spans.pieces.empty());
    }
  }
}

}  // namespace
}  // namespace flashserve
