// Zero-copy parsing of a serialized v1::AttentionRequest as gRPC hands it over: a list of byte
// slices. Everything except the three tensors' `data` fields is parsed into an ordinary message
// (the header); each tensor's data is located as spans of the slices, so the bytes can be copied
// once, straight into the buffer the backend computes from (pinned staging on a GPU).
//
// Semantics match protobuf's own parser (checked by tests/fuzz/fuzz_request_wire.cc against
// ParseFromArray): a repeated q/k/v field merges into the earlier one (the last data wins), unknown
// fields are kept, malformed input is rejected. It differs only on encodings no serializer writes:
// groups (wire types 3/4) and varints whose bits run past 64 (or tags past 32) are rejected, and
// tags/lengths padded to 6-10 bytes are accepted. No gRPC dependency.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "flashserve/v1/attention.pb.h"

namespace flashserve {

/// Where one tensor's data bytes are inside the slices, in order.
struct TensorSpans {
  std::vector<std::string_view> pieces;
  int64_t bytes = 0;

  /// Copies the data into `dest` (bytes long).
  void CopyTo(char* dest) const;
};

struct WireRequest {
  v1::AttentionRequest header;  // q/k/v have dtype and shape but empty data
  TensorSpans data[3];          // q, k, v; pointing into the caller's slices
};

/// Parses `slices` (the serialized request, split anywhere). The slices must outlive every use of
/// `out->data`. INVALID_ARGUMENT ("flashserve.v1.AttentionRequest: ...") on malformed bytes.
absl::Status ParseAttentionRequestWire(const std::vector<std::string_view>& slices,
                                       WireRequest* out);

}  // namespace flashserve
