#include "api/validation.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flashserve {
namespace {

using kernels::DType;

constexpr const char* kQDimNames[4] = {"batch", "seqlen_q", "heads_q", "head_dim"};
constexpr const char* kKvDimNames[4] = {"batch", "seqlen_k", "heads_kv", "head_dim"};

std::string DTypeName(int value) {
  const auto* descriptor = v1::DType_descriptor()->FindValueByNumber(value);
  return descriptor ? descriptor->name() : absl::StrCat("DType(", value, ")");
}

// At most 8 dims are spelled out: a hostile rank-100000 shape must not make a 300 KB message.
std::string ShapeString(const v1::Tensor& t) {
  constexpr int kShown = 8;
  if (t.shape_size() <= kShown) return absl::StrCat("[", absl::StrJoin(t.shape(), ", "), "]");
  return absl::StrCat("[", absl::StrJoin(t.shape().begin(), t.shape().begin() + kShown, ", "),
                      ", ... (", t.shape_size(), " dims)]");
}

absl::Status CheckDType(const char* name, const v1::Tensor& t) {
  const int value = t.dtype();
  if (value == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".dtype: unspecified (use FLOAT16, BFLOAT16 or FLOAT32)"));
  }
  if (value != v1::FLOAT16 && value != v1::BFLOAT16 && value != v1::FLOAT32) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".dtype: unknown value ", value));
  }
  return absl::OkStatus();
}

// Rank, positive dims that fit int32, element count without overflow and under the limit.
absl::Status CheckShape(const char* name, const v1::Tensor& t, const char* const dim_names[4],
                        int64_t max_elements, int64_t* elements) {
  if (t.shape_size() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ".shape: expected rank 4 [", absl::StrJoin(dim_names, dim_names + 4, ", "),
        "], got rank ", t.shape_size(), " ", ShapeString(t)));
  }
  int64_t count = 1;
  bool overflow = false;
  for (int i = 0; i < 4; ++i) {
    const int64_t dim = t.shape(i);
    if (dim <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".shape[", i, "] (", dim_names[i], ") must be > 0, got ", dim));
    }
    if (dim > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ".shape[", i, "] (", dim_names[i],
                                                     ") = ", dim, " exceeds 2147483647"));
    }
    overflow |= __builtin_mul_overflow(count, dim, &count);
  }
  if (overflow) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".shape: element count of ", ShapeString(t), " overflows int64"));
  }
  if (count > max_elements) {
    return absl::ResourceExhaustedError(
        absl::StrCat(name, ": ", count, " elements exceed --max_tensor_elements=", max_elements));
  }
  *elements = count;
  return absl::OkStatus();
}

absl::Status CheckSameDim(const char* name, const v1::Tensor& t, const v1::Tensor& q, int dim) {
  if (t.shape(dim) != q.shape(dim)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".shape[", dim, "] (", kQDimNames[dim],
                                                   ") = ", t.shape(dim), " differs from q.shape[",
                                                   dim, "] = ", q.shape(dim)));
  }
  return absl::OkStatus();
}

absl::Status CheckBytes(const char* name, const v1::Tensor& t, int64_t elements, int64_t got) {
  const int64_t element_size = int64_t(kernels::dtype_size(static_cast<DType>(t.dtype())));
  const int64_t expected = elements * element_size;  // <= max_elements * 4: no overflow
  if (got != expected) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".data: expected ", expected, " bytes (",
                                                   ShapeString(t), " x ", element_size,
                                                   " bytes), got ", got));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionProblem> ValidateAttentionRequest(const v1::AttentionRequest& request,
                                                          const ValidationLimits& limits,
                                                          const int64_t* data_bytes) {
  const char* names[3] = {"q", "k", "v"};
  const v1::Tensor* tensors[3] = {&request.q(), &request.k(), &request.v()};
  const bool present[3] = {request.has_q(), request.has_k(), request.has_v()};
  for (int i = 0; i < 3; ++i) {
    if (!present[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(names[i], ": missing (a request carries q, k and v)"));
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (absl::Status s = CheckDType(names[i], *tensors[i]); !s.ok()) return s;
  }
  for (int i = 1; i < 3; ++i) {
    if (tensors[i]->dtype() != request.q().dtype()) {
      return absl::InvalidArgumentError(
          absl::StrCat(names[i], ".dtype: ", DTypeName(tensors[i]->dtype()),
                       " differs from q.dtype ", DTypeName(request.q().dtype())));
    }
  }
  int64_t elements[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    if (absl::Status s = CheckShape(names[i], *tensors[i], i == 0 ? kQDimNames : kKvDimNames,
                                    limits.max_tensor_elements, &elements[i]);
        !s.ok()) {
      return s;
    }
  }
  const v1::Tensor& q = request.q();
  const v1::Tensor& k = request.k();
  const v1::Tensor& v = request.v();
  for (int dim : {0, 3}) {
    if (absl::Status s = CheckSameDim("k", k, q, dim); !s.ok()) return s;
  }
  for (int dim = 0; dim < 4; ++dim) {
    if (v.shape(dim) != k.shape(dim)) {
      return absl::InvalidArgumentError(
          absl::StrCat("v.shape ", ShapeString(v), " must equal k.shape ", ShapeString(k)));
    }
  }
  if (q.shape(2) % k.shape(2) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("q.shape[2] (heads_q) = ", q.shape(2),
                     " must be a multiple of k.shape[2] (heads_kv) = ", k.shape(2)));
  }
  for (int i = 0; i < 3; ++i) {
    const int64_t got =
        data_bytes != nullptr ? data_bytes[i] : int64_t(tensors[i]->data().size());
    if (absl::Status s = CheckBytes(names[i], *tensors[i], elements[i], got); !s.ok()) return s;
  }

  const DType dtype = static_cast<DType>(q.dtype());
  if (std::find(limits.dtypes.begin(), limits.dtypes.end(), dtype) == limits.dtypes.end()) {
    std::vector<std::string> supported;
    for (DType d : limits.dtypes) supported.push_back(DTypeName(static_cast<int>(d)));
    return absl::InvalidArgumentError(absl::StrCat(
        "q.dtype: ", DTypeName(q.dtype()), " is not supported by the ", limits.backend_name,
        " backend (supported: ", absl::StrJoin(supported, ", "), ")"));
  }
  const int64_t head_dim = q.shape(3);
  const bool head_dim_ok = limits.head_dims.empty()
                               ? head_dim <= limits.max_head_dim
                               : std::find(limits.head_dims.begin(), limits.head_dims.end(),
                                           head_dim) != limits.head_dims.end();
  if (!head_dim_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim: ", head_dim, " is not supported by the ", limits.backend_name, " backend (",
        limits.head_dims.empty()
            ? absl::StrCat("max ", limits.max_head_dim)
            : absl::StrCat("supported: ", absl::StrJoin(limits.head_dims, ", ")),
        ")"));
  }

  // Before anything is allocated (the CUDA kernels refused these after the device buffers were).
  for (const auto& [name, value] :
       {std::pair{"batch", q.shape(0)}, std::pair{"heads_q", q.shape(2)}}) {
    if (limits.max_batch_and_heads > 0 && value > limits.max_batch_and_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("q.shape: ", name, " ", value, " exceeds the ", limits.backend_name,
                       " backend's limit of ", limits.max_batch_and_heads, " (split the request)"));
    }
  }

  float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  if (request.has_softmax_scale()) {
    scale = request.softmax_scale();
    if (!std::isfinite(scale) || scale <= 0.f || scale > kMaxSoftmaxScale) {
      return absl::InvalidArgumentError(absl::StrCat(
          "softmax_scale: must be finite, > 0 and <= ", kMaxSoftmaxScale, ", got ", scale));
    }
  }

  AttentionProblem problem;
  problem.dtype = dtype;
  problem.batch = static_cast<int>(q.shape(0));
  problem.seqlen_q = static_cast<int>(q.shape(1));
  problem.heads_q = static_cast<int>(q.shape(2));
  problem.head_dim = static_cast<int>(head_dim);
  problem.seqlen_k = static_cast<int>(k.shape(1));
  problem.heads_kv = static_cast<int>(k.shape(2));
  problem.causal = request.causal();
  problem.softmax_scale = scale;
  problem.return_lse = request.return_lse();
  return problem;
}

}  // namespace flashserve
