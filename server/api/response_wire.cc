#include "api/response_wire.h"

namespace flashserve {

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(char(v | 0x80));
    v >>= 7;
  }
  out->push_back(char(v));
}

std::string TensorFieldPrefix(int field, const v1::Tensor& header, size_t data_bytes) {
  v1::Tensor fields;
  fields.set_dtype(header.dtype());
  *fields.mutable_shape() = header.shape();
  const std::string head = fields.SerializeAsString();
  std::string data_tag;
  AppendVarint((3 << 3) | 2, &data_tag);  // Tensor.data, length-delimited
  AppendVarint(data_bytes, &data_tag);
  std::string prefix;
  AppendVarint(uint64_t(field << 3) | 2, &prefix);
  AppendVarint(head.size() + data_tag.size() + data_bytes, &prefix);
  prefix += head;
  prefix += data_tag;
  return prefix;
}

ResponsePieces EncodeAttentionResponse(const v1::AttentionResponse& header, std::string_view out,
                                       std::string_view lse) {
  ResponsePieces pieces;
  v1::AttentionResponse rest = header;
  if (!out.empty()) {
    pieces.out_prefix = TensorFieldPrefix(1, header.out(), out.size());
    rest.clear_out();
  } else {
    rest.mutable_out()->clear_data();
  }
  if (!lse.empty()) {
    pieces.lse_prefix = TensorFieldPrefix(2, header.lse(), lse.size());
    rest.clear_lse();
  } else if (rest.has_lse()) {
    rest.mutable_lse()->clear_data();
  }
  pieces.rest = rest.SerializeAsString();
  return pieces;
}

}  // namespace flashserve
