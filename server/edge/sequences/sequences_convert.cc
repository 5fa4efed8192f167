#include "edge/sequences/sequences_convert.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace flashserve {

namespace {
constexpr int64_t kMaxDim = int64_t(1) << 31;
constexpr int64_t kMaxFactor = int64_t(1) << 16;
}  // namespace

absl::StatusOr<kvcache::HostRows> RowsFromTensor(const v1::Tensor& tensor, const char* name,
                                                 bool optional) {
  if (tensor.has_shm()) {  // else read as "0 data bytes do not match shape"
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".shm: shared memory is not supported in this call (DecodeStep takes it)"));
  }
  if (optional && tensor.shape_size() == 0 && tensor.data().empty()) return kvcache::HostRows();
  return RowsFromBytes(tensor, name, tensor.data().data(), int64_t(tensor.data().size()));
}

absl::StatusOr<kvcache::HostRows> RowsFromBytes(const v1::Tensor& tensor, const char* name,
                                                const char* data, int64_t bytes) {
  kvcache::HostRows rows;
  if (tensor.dtype() != v1::FLOAT16 && tensor.dtype() != v1::BFLOAT16) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype must be FLOAT16 or BFLOAT16"));
  }
  if (tensor.shape_size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": shape must be [rows, heads, head_dim], got rank ", tensor.shape_size()));
  }
  for (int64_t dim : tensor.shape()) {
    if (dim < 0 || dim >= kMaxDim) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": dimension ", dim, " out of range"));
    }
  }
  rows.dtype = static_cast<kernels::DType>(tensor.dtype());
  rows.rows = tensor.shape(0);
  rows.heads = tensor.shape(1);
  rows.head_dim = tensor.shape(2);
  // heads and head_dim < 2^16 keep row_bytes < 2^33; rows are compared by division (no overflow).
  const bool sane = rows.heads >= 1 && rows.heads <= kMaxFactor && rows.head_dim >= 1 &&
                    rows.head_dim <= kMaxFactor;
  const int64_t row_bytes = sane ? rows.heads * rows.head_dim * 2 : 1;
  if (!sane || bytes % row_bytes != 0 || bytes / row_bytes != rows.rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", bytes, " data bytes do not match shape [", rows.rows, ", ",
                     rows.heads, ", ", rows.head_dim, "] of 2-byte elements"));
  }
  rows.data = data;
  return rows;
}

absl::StatusOr<kvcache::LayerRows> LayerRowsFrom(const v1::LayerKV& layer) {
  kvcache::LayerRows out;
  out.layer = layer.layer();
  absl::StatusOr<kvcache::HostRows> k = RowsFromTensor(layer.k(), "k", false);
  if (!k.ok()) return k.status();
  absl::StatusOr<kvcache::HostRows> v = RowsFromTensor(layer.v(), "v", false);
  if (!v.ok()) return v.status();
  out.k = *k;
  out.v = *v;
  absl::StatusOr<int64_t> expected =
      ExpectedLengthFrom(layer.has_expected_length(), layer.expected_length());
  if (!expected.ok()) return expected.status();
  out.expected_length = *expected;
  return out;
}

absl::StatusOr<int64_t> ExpectedLengthFrom(bool has, int64_t value) {
  if (!has) return -1;
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected_length must be >= 0 (the layer's length before the rows), got ", value));
  }
  return value;
}

absl::StatusOr<kvcache::CreateRequest> CreateRequestFrom(const v1::CreateSequenceRequest& request) {
  kvcache::CreateRequest out;
  out.shape.num_layers = request.num_layers();
  out.shape.heads_q = request.heads_q();
  out.shape.heads_kv = request.heads_kv();
  out.shape.head_dim = request.head_dim();
  if (request.dtype() != v1::FLOAT16 && request.dtype() != v1::BFLOAT16) {
    return absl::InvalidArgumentError("dtype must be FLOAT16 or BFLOAT16");
  }
  out.shape.dtype = static_cast<kernels::DType>(request.dtype());
  out.max_tokens = request.max_tokens();
  out.label = request.label();
  out.create_token = request.create_token();  // checked by the cache (never echoed)
  for (const v1::LayerKV& layer : request.prefix()) {
    if (layer.has_expected_length()) {
      return absl::InvalidArgumentError(
          "a prefix layer carries no expected_length (it is for Append: a new sequence's layers "
          "start empty)");
    }
    absl::StatusOr<kvcache::LayerRows> rows = LayerRowsFrom(layer);
    if (!rows.ok()) return rows.status();
    out.prefix.push_back(*rows);
  }
  return out;
}

absl::StatusOr<float> ScaleFrom(bool has_scale, float scale, int64_t head_dim) {
  if (!has_scale) return 1.f / std::sqrt(float(head_dim));
  if (!std::isfinite(scale) || !(scale > 0.f) || scale > 1e4f) {
    return absl::InvalidArgumentError("softmax_scale must be finite, > 0 and <= 1e4");
  }
  return scale;
}

char* PrepareOutput(v1::Tensor* tensor, v1::DType dtype, std::initializer_list<int64_t> shape,
                    int64_t element_bytes) {
  tensor->set_dtype(dtype);
  int64_t elements = 1;
  for (int64_t dim : shape) {
    tensor->add_shape(dim);
    elements *= dim;
  }
  std::string* data = tensor->mutable_data();
  data->resize(size_t(elements * element_bytes));
  return data->data();
}

}  // namespace flashserve
