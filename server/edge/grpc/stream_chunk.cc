#include "edge/grpc/stream_chunk.h"

#include <climits>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace flashserve {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;

absl::Status ParseChunk(google::protobuf::io::ZeroCopyInputStream* in,
                        const std::function<absl::StatusOr<char*>(const ChunkHeader&)>& place,
                        ChunkHeader* header) {
  *header = ChunkHeader{};  // proto3 leaves zero fields out: nothing may carry over
  CodedInputStream stream(in);
  stream.SetTotalBytesLimit(INT_MAX);
  bool have_data = false;
  auto bad = [](const char* what) {
    return absl::InvalidArgumentError(absl::StrCat("AttentionChunk: ", what));
  };
  for (;;) {
    const uint32_t tag = stream.ReadTag();
    if (tag == 0) break;
    const int field = int(WireFormatLite::GetTagFieldNumber(tag));
    const auto wire = WireFormatLite::GetTagWireType(tag);
    if (field >= 1 && field <= 4 && have_data) {
      return bad("fields after data (serialize in field order)");
    }
    switch (field) {
      case 1: {  // session_id
        uint32_t length = 0;
        if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !stream.ReadVarint32(&length) ||
            length > 256 || !stream.ReadString(&header->session_id, int(length))) {
          return bad("malformed session_id");
        }
        break;
      }
      case 2:
      case 3: {  // tensor, offset
        uint64_t value = 0;
        if (wire != WireFormatLite::WIRETYPE_VARINT || !stream.ReadVarint64(&value)) {
          return bad(field == 2 ? "malformed tensor" : "malformed offset");
        }
        if (field == 2) {
          header->tensor = value > 1000 ? -1 : int(value);
        } else {
          header->offset = int64_t(value);  // a negative int64 arrives as a huge varint
        }
        break;
      }
      case 4: {  // data
        uint32_t length = 0;
        if (wire != WireFormatLite::WIRETYPE_LENGTH_DELIMITED || !stream.ReadVarint32(&length) ||
            length > uint32_t(INT_MAX)) {
          return bad("malformed data");
        }
        header->length = int64_t(length);
        absl::StatusOr<char*> dest = place(*header);
        if (!dest.ok()) return dest.status();
        if (length > 0 && !stream.ReadRaw(*dest, int(length))) return bad("truncated data");
        have_data = true;
        break;
      }
      default:
        if (!WireFormatLite::SkipField(&stream, tag)) return bad("malformed unknown field");
    }
  }
  if (!stream.ConsumedEntireMessage()) return bad("malformed message");
  if (!have_data) return bad("no data field");
  return absl::OkStatus();
}

void AppendChunkHeader(int tensor, int64_t offset, int64_t data_length, std::string* out) {
  auto varint = [out](uint64_t v) {
    while (v >= 0x80) {
      out->push_back(char(v | 0x80));
      v >>= 7;
    }
    out->push_back(char(v));
  };
  out->push_back(char((2 << 3) | 0));
  varint(uint64_t(tensor));
  out->push_back(char((3 << 3) | 0));
  varint(uint64_t(offset));
  out->push_back(char((4 << 3) | 2));
  varint(uint64_t(data_length));
}

}  // namespace flashserve
