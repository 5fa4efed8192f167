// Element types understood by every attention backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace flashserve::kernels {

// Values match flashserve.v1.DType in proto/flashserve/v1/attention.proto.
enum class DType : int32_t {
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat32 = 3,
};

constexpr size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
  }
  return "unknown";
}

}  // namespace flashserve::kernels
