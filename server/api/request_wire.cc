#include "api/request_wire.h"

#include <cstring>
#include <string>

#include "api/response_wire.h"  // AppendVarint
#include "common/protobuf_errors.h"

namespace flashserve {
namespace {

constexpr int kWireVarint = 0, kWireFixed64 = 1, kWireLengthDelimited = 2, kWireFixed32 = 5;
constexpr int kTensorDataField = 3;  // Tensor.data

// Sequential reads over the slices; every read fails (false) rather than run past the end.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<std::string_view>& slices) : slices_(slices) {
    for (std::string_view s : slices) total_ += s.size();
    Advance(0);  // past leading empty slices
  }

  size_t position() const { return position_; }
  size_t total() const { return total_; }

  bool ReadVarint(uint64_t* value) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t byte = 0;
      if (!ReadByte(&byte)) return false;
      result |= uint64_t(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) {
        *value = result;
        return shift < 63 || byte <= 1;  // the tenth byte holds one bit
      }
    }
    return false;  // more than ten bytes
  }

  // Consumes n bytes; appends them to `copy` if given, and their location to `spans` if given.
  bool Take(size_t n, std::string* copy, std::vector<std::string_view>* spans) {
    if (n > total_ - position_) return false;
    while (n > 0) {
      std::string_view slice = slices_[index_];
      const size_t k = std::min(n, slice.size() - offset_);
      if (k > 0) {
        if (copy != nullptr) copy->append(slice.data() + offset_, k);
        if (spans != nullptr) spans->emplace_back(slice.data() + offset_, k);
      }
      Advance(k);
      n -= k;
    }
    return true;
  }

 private:
  bool ReadByte(uint8_t* byte) {
    if (position_ >= total_) return false;
    *byte = uint8_t(slices_[index_][offset_]);
    Advance(1);
    return true;
  }
  void Advance(size_t k) {
    offset_ += k;
    position_ += k;
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
    // Empty slices are skipped: slices_[index_] is readable whenever position_ < total_.
  }

  const std::vector<std::string_view>& slices_;
  size_t index_ = 0, offset_ = 0, position_ = 0, total_ = 0;
};

// Reads one field's tag and value and re-encodes it into `out` (protobuf will parse it there).
// Groups (wire types 3/4, deprecated) are rejected.
bool CopyField(SliceReader* in, uint64_t tag, std::string* out) {
  AppendVarint(tag, out);
  switch (int(tag & 7)) {
    case kWireVarint: {
      uint64_t value = 0;
      if (!in->ReadVarint(&value)) return false;
      AppendVarint(value, out);
      return true;
    }
    case kWireFixed64:
      return in->Take(8, out, nullptr);
    case kWireFixed32:
      return in->Take(4, out, nullptr);
    case kWireLengthDelimited: {
      uint64_t length = 0;
      if (!in->ReadVarint(&length)) return false;
      AppendVarint(length, out);
      return in->Take(length, out, nullptr);
    }
    default:
      return false;
  }
}

bool ReadTag(SliceReader* in, uint64_t* tag) {
  return in->ReadVarint(tag) && *tag <= 0xffffffffu && (*tag >> 3) != 0;
}

// One occurrence of a Tensor submessage, `length` bytes: its fields except data go to `header`,
// its data (the last one, as protobuf keeps) to `spans`.
bool ParseTensor(SliceReader* in, uint64_t length, std::string* header, TensorSpans* spans) {
  if (length > in->total() - in->position()) return false;
  const size_t end = in->position() + length;
  while (in->position() < end) {
    uint64_t tag = 0;
    if (!ReadTag(in, &tag)) return false;
    if (tag == ((kTensorDataField << 3) | kWireLengthDelimited)) {
      uint64_t bytes = 0;
      if (!in->ReadVarint(&bytes) || bytes > end - in->position()) return false;
      spans->pieces.clear();
      spans->bytes = int64_t(bytes);
      if (!in->Take(bytes, nullptr, &spans->pieces)) return false;
    } else if (!CopyField(in, tag, header)) {
      return false;
    }
  }
  return in->position() == end;  // a field ran past the submessage's length
}

}  // namespace

void TensorSpans::CopyTo(char* dest) const {
  for (std::string_view piece : pieces) {
    std::memcpy(dest, piece.data(), piece.size());
    dest += piece.size();
  }
}

absl::Status ParseAttentionRequestWire(const std::vector<std::string_view>& slices,
                                       WireRequest* out) {
  auto malformed = [] {
    return absl::InvalidArgumentError("flashserve.v1.AttentionRequest: malformed protobuf bytes");
  };
  SliceReader in(slices);
  std::string skeleton;  // the request without tensor data, re-encoded for ParseFromString
  for (TensorSpans& spans : out->data) spans = TensorSpans{};
  while (in.position() < in.total()) {
    uint64_t tag = 0;
    if (!ReadTag(&in, &tag)) return malformed();
    const uint64_t field = tag >> 3;
    if (field >= 1 && field <= 3 && (tag & 7) == kWireLengthDelimited) {  // q, k, v
      uint64_t length = 0;
      if (!in.ReadVarint(&length)) return malformed();
      std::string tensor;
      if (!ParseTensor(&in, length, &tensor, &out->data[field - 1])) return malformed();
      AppendVarint(tag, &skeleton);
      AppendVarint(tensor.size(), &skeleton);
      skeleton += tensor;
    } else if (!CopyField(&in, tag, &skeleton)) {
      return malformed();
    }
  }
  // With protobuf's reason when it gives one (a string field that is not UTF-8 is named).
  return ParseMessage(skeleton, &out->header);
}

}  // namespace flashserve
