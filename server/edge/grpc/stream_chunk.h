// The striped stream's chunk wire format: one AttentionChunk (attention.proto) parsed straight
// from gRPC's receive slices into its place in the session's buffers, and the header that precedes
// each downloaded chunk's data. Pure functions (no gRPC server) so tests drive them directly.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace google::protobuf::io {
class ZeroCopyInputStream;
}  // namespace google::protobuf::io

namespace flashserve {

/// The fields of one AttentionChunk before its data.
struct ChunkHeader {
  std::string session_id;
  int tensor = 0;  // v1::TensorName
  int64_t offset = 0;
  int64_t length = 0;  // of data
};

/// Parses one serialized AttentionChunk from `in`. When the data field starts, calls
/// place(header) for the destination of header.length bytes and copies them there directly (the
/// only copy). Unknown fields are skipped. INVALID_ARGUMENT on malformed input, on data before
/// tensor/offset, on a second data field, or when there is no data field; place's error otherwise.
/// On success `header` holds what was parsed and the copy is complete.
absl::Status ParseChunk(google::protobuf::io::ZeroCopyInputStream* in,
                        const std::function<absl::StatusOr<char*>(const ChunkHeader&)>& place,
                        ChunkHeader* header);

/// Serializes the AttentionChunk header fields (tensor, offset, data tag + length) that precede
/// `data_length` bytes of data; appended to `out`. The session id is left out (Download).
void AppendChunkHeader(int tensor, int64_t offset, int64_t data_length, std::string* out);

}  // namespace flashserve
