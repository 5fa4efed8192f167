// Serializing an AttentionResponse without copying its tensors: the protobuf bytes of everything
// else, with the O and LSE data left where they are so the edge can send them as slices that
// point into the request's buffers. Parsing the concatenation gives the full message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "flashserve/v1/attention.pb.h"

namespace flashserve {

struct ResponsePieces {
  std::string out_prefix;  // out field: tag, length, dtype/shape, data tag and length
  std::string lse_prefix;  // likewise for lse; empty when there is no lse
  std::string rest;        // timing, kernel, request_id (and out/lse when their data is empty)
};

/// Protobuf's varint encoding of `v`, appended to `out`.
void AppendVarint(uint64_t v, std::string* out);
/// A Tensor field's bytes up to its data: the tag and length of message field `field`, `header`'s
/// dtype and shape (its data ignored), then the data field's tag and length (data_bytes).
std::string TensorFieldPrefix(int field, const v1::Tensor& header, size_t data_bytes);

/// The wire bytes are out_prefix + out + lse_prefix + lse + rest. `header` carries out/lse dtype and
/// shape (its data fields are ignored); `out`/`lse` are the tensors' bytes (lse empty: no lse
/// field unless header has one).
ResponsePieces EncodeAttentionResponse(const v1::AttentionResponse& header, std::string_view out,
                                       std::string_view lse);

}  // namespace flashserve
