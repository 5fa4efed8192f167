// libFuzzer target: ParseAttentionRequestWire (server/api/request_wire.h), the zero-copy parser the
// unary edge runs over the slices gRPC received, against AttentionRequest::ParseFromArray.
//
// Input: how to split, then the protobuf bytes.
//   byte 0: bits 0-3: number of cuts n; bit 6: an empty slice between every two;
//           bit 7: one slice per byte (the cuts are then ignored)
//   2n bytes: the cut points, little-endian uint16, each modulo (size of the bytes + 1)
//   the rest: the serialized request; each slice is copied into its own allocation, so ASan sees
//   a read past one.
// An empty input is the empty slice list.
//
// Oracles:
//  1. Ours on the slices and ours on the unsplit bytes give the same status, header and data.
//  2. Ours fails only with INVALID_ARGUMENT "flashserve.v1.AttentionRequest: ...".
//  3. Ours and protobuf both succeed or both fail, except where the bytes use one of the encodings
//     on which the two are known to differ (FirstDeviation below; found by this target, see
//     tests/fuzz/RESULTS.md). Each allows one direction only, and only when the walk that both
//     parsers make meets it before anything else malformed.
//  4. Both succeed: ours' header equals protobuf's message with the q/k/v data cleared (unknown
//     fields included), and the spans lie inside the slices and reproduce protobuf's data.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "api/request_wire.h"
#include "fuzz_check.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"

namespace {

using flashserve::TensorSpans;
using flashserve::WireRequest;
namespace v1 = flashserve::v1;

// Encodings protobuf 3.21 and request_wire.cc read differently; none is written by a serializer.
enum class Deviation {
  kNone,       // the walk ended: the message is well formed as far as its tags and lengths go
  kMalformed,  // the walk met plainly malformed bytes first (both parsers refuse them)
  kGroup,           // wire type 3: protobuf keeps an unknown group; ours refuses groups
  kVarintOverflow,  // a 10-byte varint whose 10th byte is > 1: protobuf drops the bits past 64;
                    // ours refuses it
  kTagOverflow,     // a 5-byte tag over 32 bits: protobuf keeps the low 32 bits; ours refuses it
  kLongTag,         // a tag of 6..10 bytes (zero-padded): protobuf reads at most 5; ours accepts
  kLongLength,      // likewise a length of 6..10 bytes
};

bool OursFailsProtobufParses(Deviation d) {
  return d == Deviation::kGroup || d == Deviation::kVarintOverflow ||
         d == Deviation::kTagOverflow;
}

const char* Name(Deviation d) {
  switch (d) {
    case Deviation::kNone: return "none";
    case Deviation::kMalformed: return "none (malformed first)";
    case Deviation::kGroup: return "group";
    case Deviation::kVarintOverflow: return "varint over 64 bits";
    case Deviation::kTagOverflow: return "tag over 32 bits";
    case Deviation::kLongTag: return "tag over 5 bytes";
    case Deviation::kLongLength: return "length over 5 bytes";
  }
  return "?";
}

// A varint at p (at most 10 bytes, else false); its length in bytes and the 10th byte.
bool ScanVarint(const uint8_t*& p, const uint8_t* end, uint64_t* value, int* bytes,
                uint8_t* last) {
  uint64_t v = 0;
  for (int i = 0; i < 10 && p < end; ++i) {
    const uint8_t b = *p++;
    v |= uint64_t(b & 0x7f) << (7 * i);
    if ((b & 0x80) == 0) {
      *value = v;
      *bytes = i + 1;
      *last = b;
      return true;
    }
  }
  return false;  // cut short, or over 10 bytes: both refuse
}

// Walks the message as both parsers do (the request's fields; inside q/k/v, the tensor's fields;
// other length-delimited contents are opaque to both, or parsed by protobuf alike) and returns the
// first deviating encoding met, kMalformed if plainly malformed bytes come first, else kNone.
Deviation FirstDeviation(const uint8_t* p, const uint8_t* end, bool tensor) {
  while (p < end) {
    uint64_t tag = 0, value = 0;
    int bytes = 0;
    uint8_t last = 0;
    if (!ScanVarint(p, end, &tag, &bytes, &last)) return Deviation::kMalformed;
    if (bytes > 5) return Deviation::kLongTag;
    if (tag > 0xffffffffu) return Deviation::kTagOverflow;
    if ((tag >> 3) == 0) return Deviation::kMalformed;
    switch (tag & 7) {
      case 0:
        if (!ScanVarint(p, end, &value, &bytes, &last)) return Deviation::kMalformed;
        if (bytes == 10 && last > 1) return Deviation::kVarintOverflow;
        break;
      case 1:
      case 5: {
        const size_t n = (tag & 7) == 1 ? 8 : 4;
        if (size_t(end - p) < n) return Deviation::kMalformed;
        p += n;
        break;
      }
      case 2: {
        if (!ScanVarint(p, end, &value, &bytes, &last)) return Deviation::kMalformed;
        if (bytes > 5) return Deviation::kLongLength;
        if (value > uint64_t(end - p)) return Deviation::kMalformed;
        const uint64_t field = tag >> 3;
        if (!tensor && field >= 1 && field <= 3) {
          const Deviation inner = FirstDeviation(p, p + value, true);
          if (inner != Deviation::kNone) return inner;
        }
        p += value;
        break;
      }
      case 3:
        return Deviation::kGroup;
      default:
        return Deviation::kMalformed;  // end group without a start, wire types 6 and 7: both refuse
    }
  }
  return Deviation::kNone;
}

struct Slices {
  std::vector<std::unique_ptr<char[]>> storage;
  std::vector<std::string_view> views;
  void Add(const uint8_t* data, size_t n) {
    if (n == 0) {
      views.emplace_back();
      return;
    }
    storage.push_back(std::make_unique<char[]>(n));
    std::memcpy(storage.back().get(), data, n);
    views.emplace_back(storage.back().get(), n);
  }
};

bool InsideSlices(std::string_view piece, const Slices& slices) {
  const auto begin = reinterpret_cast<uintptr_t>(piece.data());
  for (std::string_view s : slices.views) {
    const auto s_begin = reinterpret_cast<uintptr_t>(s.data());
    if (begin >= s_begin && begin + piece.size() <= s_begin + s.size()) return true;
  }
  return false;
}

std::string Gather(const TensorSpans& spans) {
  int64_t sum = 0;
  for (std::string_view piece : spans.pieces) sum += int64_t(piece.size());
  FUZZ_CHECK(sum == spans.bytes, "pieces add up to " + std::to_string(sum) + " bytes, not " +
                                     std::to_string(spans.bytes));
  std::string data(size_t(spans.bytes), '\0');
  spans.CopyTo(data.data());
  return data;
}

std::string Short(const google::protobuf::Message& m) { return m.ShortDebugString().substr(0, 600); }

// Field by field (a NaN softmax_scale equals itself) and byte for byte (same NaN bits, same
// unknown fields in the same order).
bool Same(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  static google::protobuf::util::DefaultFieldComparator* const comparator = [] {
    auto* c = new google::protobuf::util::DefaultFieldComparator;
    c->set_treat_nan_as_equal(true);
    return c;
  }();
  google::protobuf::util::MessageDifferencer differencer;
  differencer.set_field_comparator(comparator);
  return differencer.Compare(a, b) && a.SerializeAsString() == b.SerializeAsString();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  flashserve::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The split, then the message.
  Slices slices;
  const uint8_t* message = data;
  size_t message_size = 0;
  if (size > 0) {
    const uint8_t mode = data[0];
    size_t cuts_n = mode & 0x0f;
    cuts_n = std::min(cuts_n, (size - 1) / 2);
    message = data + 1 + 2 * cuts_n;
    message_size = size - 1 - 2 * cuts_n;
    std::vector<size_t> cuts;
    if (mode & 0x80) {
      for (size_t i = 1; i < message_size; ++i) cuts.push_back(i);
    } else {
      for (size_t i = 0; i < cuts_n; ++i) {
        cuts.push_back((data[1 + 2 * i] | size_t(data[2 + 2 * i]) << 8) % (message_size + 1));
      }
      std::sort(cuts.begin(), cuts.end());
    }
    cuts.push_back(message_size);
    size_t begin = 0;
    for (size_t c : cuts) {
      if ((mode & 0x40) && begin > 0) slices.Add(nullptr, 0);
      slices.Add(message + begin, c - begin);
      begin = c;
    }
  }

  WireRequest ours;
  const absl::Status status = flashserve::ParseAttentionRequestWire(slices.views, &ours);
  if (!status.ok()) {
    FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument, status.ToString());
    FUZZ_CHECK(absl::StartsWith(status.message(), "flashserve.v1.AttentionRequest:"), status.ToString());
  }

  // 1. The split does not matter.
  std::vector<std::string_view> unsplit;
  if (message_size > 0) unsplit.emplace_back(reinterpret_cast<const char*>(message), message_size);
  WireRequest whole;
  const absl::Status whole_status = flashserve::ParseAttentionRequestWire(unsplit, &whole);
  FUZZ_CHECK(whole_status.ok() == status.ok(),
             "split: " + status.ToString() + ", unsplit: " + whole_status.ToString());

  // 3. Protobuf agrees, but where a known deviation explains it.
  v1::AttentionRequest reference;
  const bool protobuf_ok = reference.ParseFromArray(message, int(message_size));
  if (protobuf_ok != status.ok()) {
    const Deviation d = FirstDeviation(message, message + message_size, false);
    FUZZ_CHECK(d != Deviation::kNone && d != Deviation::kMalformed &&
                   OursFailsProtobufParses(d) == protobuf_ok,
               std::string("protobuf ") + (protobuf_ok ? "parses" : "refuses") +
                   " bytes that ours " + (status.ok() ? "parses" : "refuses") +
                   " (deviation met: " + Name(d) + "); ours: " + status.ToString() +
                   (protobuf_ok ? "; protobuf: " + Short(reference) : ""));
  }
  if (!status.ok()) return 0;

  const std::string* ref_data[3] = {&reference.q().data(), &reference.k().data(),
                                    &reference.v().data()};
  for (int t = 0; t < 3; ++t) {
    const TensorSpans& spans = ours.data[t];
    for (std::string_view piece : spans.pieces) {
      FUZZ_CHECK(piece.empty() || InsideSlices(piece, slices), "a piece is not inside a slice");
    }
    const std::string got = Gather(spans);
    FUZZ_CHECK(got == Gather(whole.data[t]), "tensor " + std::to_string(t) +
                                                 ": split and unsplit data differ");
    if (protobuf_ok) {
      FUZZ_CHECK(got == *ref_data[t], "tensor " + std::to_string(t) + ": " +
                                          std::to_string(got.size()) + " bytes of data, protobuf " +
                                          std::to_string(ref_data[t]->size()));
    }
  }
  FUZZ_CHECK(ours.header.q().data().empty() && ours.header.k().data().empty() &&
                 ours.header.v().data().empty(),
             "data left in the header");
  FUZZ_CHECK(Same(ours.header, whole.header),
             "split: " + Short(ours.header) + "\nunsplit: " + Short(whole.header));
  if (!protobuf_ok) return 0;

  // 4. The header is protobuf's message without the data.
  if (reference.has_q()) reference.mutable_q()->clear_data();
  if (reference.has_k()) reference.mutable_k()->clear_data();
  if (reference.has_v()) reference.mutable_v()->clear_data();
  FUZZ_CHECK(Same(ours.header, reference),
             "ours: " + Short(ours.header) + "\nprotobuf: " + Short(reference));
  return 0;
}
