// KServe v2 REST: JSON request headers and responses, metadata documents, HTTP status codes.
#include "edge/http/kserve_json.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "flashserve/kernels/dtype.h"
#include "flashserve/kernels/float_convert.h"
#include "nlohmann/json.hpp"

namespace flashserve::kserve {
namespace {

using nlohmann::json;

constexpr int kMaxJsonDataDepth = 32;

ParamValue FromJson(const json& value) {
  ParamValue v;
  if (value.is_boolean()) {
    v.type = ParamValue::kBool;
    v.b = value.get<bool>();
  } else if (value.is_number_integer()) {
    v.type = ParamValue::kInt;
    if (value.is_number_unsigned()) {
      v.u = value.get<uint64_t>();
      v.i = v.u > uint64_t(std::numeric_limits<int64_t>::max())
                ? std::numeric_limits<int64_t>::max()
                : int64_t(v.u);
      v.d = double(v.u);
    } else {
      v.i = value.get<int64_t>();
      v.u = uint64_t(v.i);
      v.d = double(v.i);
      v.negative = v.i < 0;
    }
  } else if (value.is_number_float()) {
    v.type = ParamValue::kDouble;
    v.d = value.get<double>();
  } else if (value.is_string()) {
    v.type = ParamValue::kString;
    v.s = value.get<std::string>();
  }
  return v;
}
// A JSON number as the float to store as `dtype`. FP16 / BF16 round from the float, so the float
// is x rounded to odd (toward zero, its last bit set when inexact): rounding that to the narrower
// type gives x rounded once, to nearest even. A plain cast rounded twice (1.0004883 became 1.0 in
// FP16, not 1.0009766). Call with |x| below float's overflow (FitsDtype checks it).
float ElementOf(double x, kernels::DType dtype) {
  float f = static_cast<float>(x);
  if (dtype == kernels::DType::kFloat32 || static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= 1u;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Whether `dtype` holds x as a finite number. A JSON number past its range (1e39 as FP32, 1e6 as
// FP16) would otherwise arrive as inf: a silently different input.
bool FitsDtype(double x, kernels::DType dtype) {
  constexpr double kFloatToInf = 3.4028235677973366e38;  // float's max plus half an ulp
  if (!(std::fabs(x) < kFloatToInf)) return false;        // (casting past it is undefined)
  char bytes[4];
  kernels::store_element(bytes, 0, dtype, ElementOf(x, dtype));
  return std::isfinite(kernels::load_element(bytes, 0, dtype));
}

// Counts the numbers of a (possibly nested) JSON array; INVALID_ARGUMENT for anything else and for
// a number `dtype` cannot hold.
absl::Status CountJsonNumbers(const json& data, absl::string_view field, kernels::DType dtype,
                              int depth, int64_t* count) {
  if (depth > kMaxJsonDataDepth) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: nested too deeply"));
  }
  for (const json& element : data) {
    if (element.is_array()) {
      RETURN_IF_ERROR(CountJsonNumbers(element, field, dtype, depth + 1, count));
    } else if (element.is_number()) {
      if (!FitsDtype(element.get<double>(), dtype)) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ".data[", *count, "]: ", element.get<double>(),
                         " is outside the range of ", std::string(kernels::dtype_name(dtype))));
      }
      ++*count;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".data: elements must be numbers, got ", element.type_name()));
    }
  }
  return absl::OkStatus();
}

void StoreJsonNumbers(const json& data, kernels::DType dtype, char* base, int64_t* index) {
  for (const json& element : data) {
    if (element.is_array()) {
      StoreJsonNumbers(element, dtype, base, index);
    } else {
      kernels::store_element(base, (*index)++, dtype, ElementOf(element.get<double>(), dtype));
    }
  }
}

json TensorDataJson(const v1::Tensor& tensor) {
  const auto dtype = static_cast<kernels::DType>(tensor.dtype());
  const int64_t n = int64_t(tensor.data().size() / kernels::dtype_size(dtype));
  json data = json::array();
  data.get_ref<json::array_t&>().reserve(size_t(n));
  for (int64_t i = 0; i < n; ++i) {
    // Non-finite values (LSE -inf of a fully masked row) become JSON null.
    data.push_back(double(kernels::load_element(tensor.data().data(), i, dtype)));
  }
  return data;
}

// JSON allows any integer. A size past int64 is refused here, as sent: ParamValue would hold it
// clamped to INT64_MAX, and a later error would then name a number the client never sent.
absl::Status CheckFitsInt64(absl::string_view field, const json& value) {
  if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", value.get<uint64_t>(), " does not fit a signed 64-bit integer"));
  }
  return absl::OkStatus();
}

// The shared_memory_* entries of a tensor's parameters object.
absl::Status ApplyShmParameters(const std::string& field, const json& params, ShmParams* shm) {
  for (const auto& [key, value] : params.items()) {
    RETURN_IF_ERROR(ApplyShmParameter(field, key, FromJson(value), shm).status());
  }
  return CheckShmParams(field, *shm);
}

json TensorMetadataJson(absl::string_view name, absl::string_view datatype, int rank) {
  return json{{"name", name}, {"datatype", datatype}, {"shape", std::vector<int64_t>(rank, -1)}};
}
}  // namespace

std::string ErrorJson(absl::string_view message) {
  return json{{"error", message}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

// Binary inputs seen in the JSON header: where each goes and its size; allocated last.
struct BinaryInputs {
  std::vector<std::pair<std::string*, int64_t>> targets;
  int64_t total = 0;
};

// One element of "inputs": its header into the request, then its data -- JSON numbers (stored
// now), a binary part of the body (sized now, allocated once everything checks out) or a
// shared-memory region.
absl::Status ParseRestInput(const json& input, size_t i, int64_t max_binary_bytes, bool seen[3],
                            RestInferRequest* out, BinaryInputs* binary) {
  const std::string field = absl::StrCat("inputs[", i, "]");
  if (!input.is_object()) return absl::InvalidArgumentError(field + ": must be an object");
  const auto name = input.find("name");
  if (name == input.end() || !name->is_string()) {
    return absl::InvalidArgumentError(field + ".name: missing");
  }
  const int slot = InputSlot(name->get_ref<const std::string&>());
  if (slot < 0) return UnknownInput(field, name->get_ref<const std::string&>());
  if (seen[slot]) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".name: input ", kInputNames[slot], " given twice"));
  }
  seen[slot] = true;
  const auto datatype = input.find("datatype");
  if (datatype == input.end() || !datatype->is_string()) {
    return absl::InvalidArgumentError(field + ".datatype: missing");
  }
  ASSIGN_OR_RETURN(const v1::DType dtype,
                   ParseDatatype(datatype->get_ref<const std::string&>(), field));
  v1::Tensor* tensor = TensorAt(&out->request, slot);
  tensor->set_dtype(dtype);
  const auto shape = input.find("shape");
  if (shape == input.end() || !shape->is_array()) {
    return absl::InvalidArgumentError(field + ".shape: missing");
  }
  for (const json& dim : *shape) {
    if (!dim.is_number_integer()) {
      return absl::InvalidArgumentError(field + ".shape: must be a list of integers");
    }
    RETURN_IF_ERROR(CheckFitsInt64(field + ".shape", dim));
    tensor->add_shape(dim.get<int64_t>());
  }
  int64_t binary_size = -1;
  ShmParams& shm = out->shm_inputs[slot];
  if (auto params = input.find("parameters"); params != input.end()) {
    if (!params->is_object())
      return absl::InvalidArgumentError(field + ".parameters: must be an object");
    RETURN_IF_ERROR(ApplyShmParameters(field, *params, &shm));
    if (auto size = params->find("binary_data_size"); size != params->end()) {
      RETURN_IF_ERROR(CheckFitsInt64(field + ".parameters.binary_data_size", *size));
      if (!size->is_number_integer() || size->get<int64_t>() < 0) {
        return absl::InvalidArgumentError(
            field + ".parameters.binary_data_size: must be an integer >= 0");
      }
      binary_size = size->get<int64_t>();
    }
  }
  const auto data = input.find("data");
  if (shm.set()) {
    if (data != input.end() || binary_size >= 0) {
      return absl::InvalidArgumentError(
          field + ": data given together with parameters.shared_memory_region (use one)");
    }
    return absl::OkStatus();
  }
  if (binary_size >= 0) {
    if (data != input.end()) {
      return absl::InvalidArgumentError(field + ": both data and binary_data_size given");
    }
    if (binary_size > max_binary_bytes || binary->total > max_binary_bytes - binary_size) {
      return absl::ResourceExhaustedError(
          absl::StrCat("inputs: binary_data_size adds up to more than the ", max_binary_bytes,
                       " bytes --max_request_bytes leaves after the JSON header"));
    }
    binary->total += binary_size;
    binary->targets.emplace_back(tensor->mutable_data(), binary_size);
    return absl::OkStatus();
  }
  if (data == input.end()) {
    return absl::InvalidArgumentError(field +
                                      ": no data (give \"data\" or parameters.binary_data_size)");
  }
  if (!data->is_array()) {
    return absl::InvalidArgumentError(field + ".data: must be a list of numbers");
  }
  int64_t count = 0;
  const auto kdtype = static_cast<kernels::DType>(dtype);
  RETURN_IF_ERROR(CountJsonNumbers(*data, field, kdtype, 0, &count));
  tensor->mutable_data()->resize(size_t(count) * kernels::dtype_size(kdtype));
  int64_t index = 0;
  StoreJsonNumbers(*data, kdtype, tensor->mutable_data()->data(), &index);
  return absl::OkStatus();
}

// The "outputs" list (names, binary_data, shared-memory regions); empty when not given.
absl::StatusOr<std::vector<RequestedOutput>> ParseRequestedOutputs(const json& body) {
  std::vector<RequestedOutput> requested;
  if (auto outputs = body.find("outputs"); outputs != body.end()) {
    if (!outputs->is_array()) return absl::InvalidArgumentError("outputs: must be a list");
    for (size_t i = 0; i < outputs->size(); ++i) {
      const json& output = (*outputs)[i];
      const std::string field = absl::StrCat("outputs[", i, "]");
      if (!output.is_object() || !output.contains("name") || !output["name"].is_string()) {
        return absl::InvalidArgumentError(field + ".name: missing");
      }
      RequestedOutput r;
      r.name = output["name"].get<std::string>();
      if (auto params = output.find("parameters"); params != output.end()) {
        if (!params->is_object()) {
          return absl::InvalidArgumentError(field + ".parameters: must be an object");
        }
        RETURN_IF_ERROR(ApplyShmParameters(field, *params, &r.shm));
        r.classification = params->contains("classification");
        if (auto b = params->find("binary_data"); b != params->end()) {
          if (!b->is_boolean()) {
            return absl::InvalidArgumentError(field + ".parameters.binary_data: must be a boolean");
          }
          r.binary = b->get<bool>() ? 1 : 0;
        }
      }
      requested.push_back(std::move(r));
    }
  }
  return requested;
}

// The native API's checks of shapes, dtypes and sizes, the receive budget, then the binary
// inputs' allocation (bounded by the body's size): nothing is allocated before the checks pass.
absl::Status CheckAndAllocate(const RestHeaderChecks& checks, const BinaryInputs& binary,
                              RestInferRequest* out) {
  if (checks.validation != nullptr) {
    // Shapes, dtypes and sizes as the native API checks them, before the allocation.
    int64_t data_bytes[3];
    for (int slot = 0; slot < 3; ++slot) {
      const v1::Tensor* tensor = TensorAt(&out->request, slot);
      data_bytes[slot] = int64_t(tensor->data().size());
      for (const auto& [target, size] : binary.targets) {
        if (target == &tensor->data()) data_bytes[slot] = size;
      }
      const ShmParams& shm = out->shm_inputs[slot];
      if (shm.set()) data_bytes[slot] = int64_t(std::min<uint64_t>(shm.byte_size, INT64_MAX));
    }
    RETURN_IF_ERROR(
        ValidateAttentionRequest(out->request, *checks.validation, data_bytes).status());
  }
  if (checks.reserve) RETURN_IF_ERROR(checks.reserve(binary.total));
  // Everything checks out: allocate the binary inputs (bounded by the body's size).
  for (auto& [target, size] : binary.targets) {
    if (checks.capacity_only) {
      target->reserve(size_t(size));
    } else {
      target->resize(size_t(size));
    }
    out->binary_targets.push_back(target);
    out->binary_sizes.push_back(size);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ParseRestInferHeader(absl::string_view text, int64_t binary_bytes,
                                  int64_t max_binary_bytes, RestInferRequest* out,
                                  const RestHeaderChecks& checks) {
  if (checks.validation != nullptr) {
    RETURN_IF_ERROR(ScanJson(text, 3 * checks.validation->max_tensor_elements + 4096));
  } else {
    RETURN_IF_ERROR(ScanJson(text, std::numeric_limits<int64_t>::max()));
  }
  json body;
  RETURN_IF_ERROR(ParseJsonUniqueKeys(text, &body));
  if (!body.is_object()) {
    return absl::InvalidArgumentError("request body: must be a JSON object");
  }
  if (auto it = body.find("id"); it != body.end()) {
    if (!it->is_string()) return absl::InvalidArgumentError("id: must be a string");
    out->id = it->get<std::string>();
    out->has_id = true;
    out->request.set_request_id(out->id);
  }
  InferOptions options;
  if (auto it = body.find("parameters"); it != body.end()) {
    if (!it->is_object()) return absl::InvalidArgumentError("parameters: must be an object");
    for (const auto& [key, value] : it->items()) {
      RETURN_IF_ERROR(ApplyParameter(key, FromJson(value), &options));
    }
  }
  out->timeout_us = options.timeout_us;

  const auto inputs = body.find("inputs");
  if (inputs == body.end() || !inputs->is_array()) {
    return absl::InvalidArgumentError("inputs: missing (a request carries Q, K and V)");
  }
  bool seen[3] = {false, false, false};
  BinaryInputs binary;
  for (size_t i = 0; i < inputs->size(); ++i) {
    RETURN_IF_ERROR(ParseRestInput((*inputs)[i], i, max_binary_bytes, seen, out, &binary));
  }
  RETURN_IF_ERROR(CheckAllInputs(seen));
  if (binary_bytes >= 0 && binary.total != binary_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: binary_data_size adds up to ", binary.total, " bytes but ", binary_bytes,
        " bytes follow the JSON header (Inference-Header-Content-Length)"));
  }

  ASSIGN_OR_RETURN(const std::vector<RequestedOutput> requested, ParseRequestedOutputs(body));
  ASSIGN_OR_RETURN(out->outputs, ResolveOutputs(requested, options));
  ApplyOptions(options, out->outputs, &out->request);
  return CheckAndAllocate(checks, binary, out);
}

int64_t RestInferResponse::binary_bytes() const {
  int64_t total = 0;
  for (absl::string_view b : binary) total += int64_t(b.size());
  return total;
}

RestInferResponse BuildRestInferResponse(const ModelInfo& model, const RestInferRequest& request,
                                         const v1::AttentionResponse& response) {
  RestInferResponse result;
  json body{{"model_name", model.name}, {"model_version", model.version}};
  if (request.has_id) body["id"] = request.id;
  const v1::Timing& t = response.timing();
  body["parameters"] =
      json{{"kernel", response.kernel()},  {"queue_us", t.queue_us()}, {"h2d_us", t.h2d_us()},
           {"compute_us", t.compute_us()}, {"d2h_us", t.d2h_us()},     {"total_us", t.total_us()}};
  json outputs = json::array();
  for (const OutputSpec& spec : request.outputs) {
    const v1::Tensor& tensor = spec.kind == OutputSpec::kOut ? response.out() : response.lse();
    json output{{"name", spec.kind == OutputSpec::kOut ? "O" : "LSE"},
                {"datatype", DatatypeName(tensor.dtype())},
                {"shape", std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())}};
    if (spec.shm.set()) {
      // In the client's region: nothing to send (Triton answers the same way).
    } else if (spec.binary) {
      output["parameters"] = json{{"binary_data_size", tensor.data().size()}};
      result.binary.emplace_back(tensor.data());
    } else {
      output["data"] = TensorDataJson(tensor);
    }
    outputs.push_back(std::move(output));
  }
  body["outputs"] = std::move(outputs);
  result.header = body.dump(-1, ' ', false, json::error_handler_t::replace);
  return result;
}
std::string ServerMetadataJson(const ModelInfo& model) {
  return json{{"name", model.server_name},
              {"version", model.server_version},
              {"extensions", model.extensions}}
      .dump();
}

std::string ModelMetadataJson(const ModelInfo& model) {
  const absl::string_view datatype = FirstDatatype(model);
  json inputs = json::array();
  for (const char* name : kInputNames) inputs.push_back(TensorMetadataJson(name, datatype, 4));
  json outputs =
      json::array({TensorMetadataJson("O", datatype, 4), TensorMetadataJson("LSE", "FP32", 3)});
  return json{{"name", model.name},
              {"versions", json::array({model.version})},
              {"platform", model.platform},
              {"inputs", std::move(inputs)},
              {"outputs", std::move(outputs)}}
      .dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string ModelReadyJson(const ModelInfo& model, bool ready) {
  return json{{"name", model.name}, {"ready", ready}}.dump(-1, ' ', false,
                                                           json::error_handler_t::replace);
}
}  // namespace flashserve::kserve
