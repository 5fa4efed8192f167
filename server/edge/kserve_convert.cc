#include "edge/kserve_convert.h"

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

constexpr const char* kInputNames[3] = {"Q", "K", "V"};
constexpr int kMaxJsonDataDepth = 32;

// A request parameter's value, from JSON or from an InferParameter.
struct ParamValue {
  enum Type { kBool, kInt, kDouble, kString, kOther };
  Type type = kOther;
  bool b = false;
  int64_t i = 0;  // kInt
  double d = 0;   // kInt and kDouble
};

absl::Status ApplyParameter(absl::string_view key, const ParamValue& value, InferOptions* options) {
  auto need_bool = [&](bool* target) {
    if (value.type != ParamValue::kBool) {
      return absl::InvalidArgumentError(absl::StrCat("parameters.", key, ": must be a boolean"));
    }
    *target = value.b;
    return absl::OkStatus();
  };
  if (key == "causal") return need_bool(&options->causal);
  if (key == "return_lse") return need_bool(&options->return_lse);
  if (key == "binary_data_output") return need_bool(&options->binary_data_output);
  if (key == "softmax_scale") {
    if (value.type != ParamValue::kInt && value.type != ParamValue::kDouble) {
      return absl::InvalidArgumentError("parameters.softmax_scale: must be a number");
    }
    options->has_softmax_scale = true;
    options->softmax_scale = value.d;
    return absl::OkStatus();
  }
  if (key == "timeout") {  // Triton's name: microseconds the server may take
    if (value.type != ParamValue::kInt || value.i < 0) {
      return absl::InvalidArgumentError(
          "parameters.timeout: must be an integer >= 0 (microseconds)");
    }
    options->timeout_us = value.i;
    return absl::OkStatus();
  }
  return absl::OkStatus();  // other parameters (priority, sequence_id, ...) do not apply here
}

ParamValue FromJson(const json& value) {
  ParamValue v;
  if (value.is_boolean()) {
    v.type = ParamValue::kBool;
    v.b = value.get<bool>();
  } else if (value.is_number_integer()) {
    v.type = ParamValue::kInt;
    if (value.is_number_unsigned()) {
      const uint64_t u = value.get<uint64_t>();
      v.i = u > uint64_t(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max()
                                                              : int64_t(u);
      v.d = double(u);
    } else {
      v.i = value.get<int64_t>();
      v.d = double(v.i);
    }
  } else if (value.is_number_float()) {
    v.type = ParamValue::kDouble;
    v.d = value.get<double>();
  } else if (value.is_string()) {
    v.type = ParamValue::kString;
  }
  return v;
}

ParamValue FromGrpc(const inference::InferParameter& p) {
  ParamValue v;
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      v.type = ParamValue::kBool;
      v.b = p.bool_param();
      break;
    case inference::InferParameter::kInt64Param:
      v.type = ParamValue::kInt;
      v.i = p.int64_param();
      v.d = double(v.i);
      break;
    case inference::InferParameter::kUint64Param:
      v.type = ParamValue::kInt;
      v.i = p.uint64_param() > uint64_t(std::numeric_limits<int64_t>::max())
                ? std::numeric_limits<int64_t>::max()
                : int64_t(p.uint64_param());
      v.d = double(p.uint64_param());
      break;
    case inference::InferParameter::kDoubleParam:
      v.type = ParamValue::kDouble;
      v.d = p.double_param();
      break;
    case inference::InferParameter::kStringParam:
      v.type = ParamValue::kString;
      break;
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return v;
}

struct RequestedOutput {
  std::string name;
  int binary = -1;  // -1: not said; else 0/1
};

absl::StatusOr<std::vector<OutputSpec>> ResolveOutputs(
    const std::vector<RequestedOutput>& requested, const InferOptions& options) {
  std::vector<OutputSpec> outputs;
  if (requested.empty()) {
    outputs.push_back({OutputSpec::kOut, options.binary_data_output});
    if (options.return_lse) outputs.push_back({OutputSpec::kLse, options.binary_data_output});
    return outputs;
  }
  bool seen[2] = {false, false};
  for (size_t i = 0; i < requested.size(); ++i) {
    const RequestedOutput& r = requested[i];
    OutputSpec spec;
    if (r.name == "O") {
      spec.kind = OutputSpec::kOut;
    } else if (r.name == "LSE") {
      spec.kind = OutputSpec::kLse;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("outputs[", i, "].name: unknown output \"",
                                                     r.name, "\" (this model has O and LSE)"));
    }
    if (seen[spec.kind]) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "].name: \"", r.name, "\" requested twice"));
    }
    seen[spec.kind] = true;
    spec.binary = r.binary < 0 ? options.binary_data_output : r.binary == 1;
    outputs.push_back(spec);
  }
  return outputs;
}

bool WantsLse(const std::vector<OutputSpec>& outputs) {
  for (const OutputSpec& o : outputs) {
    if (o.kind == OutputSpec::kLse) return true;
  }
  return false;
}

void ApplyOptions(const InferOptions& options, const std::vector<OutputSpec>& outputs,
                  v1::AttentionRequest* request) {
  request->set_causal(options.causal);
  if (options.has_softmax_scale) {
    // Out-of-range doubles become inf/0 here and are refused by validation.
    request->set_softmax_scale(static_cast<float>(options.softmax_scale));
  }
  request->set_return_lse(WantsLse(outputs));
}

int InputSlot(absl::string_view name) {
  for (int i = 0; i < 3; ++i) {
    if (name == kInputNames[i]) return i;
  }
  return -1;
}

v1::Tensor* TensorAt(v1::AttentionRequest* request, int slot) {
  return slot == 0 ? request->mutable_q() : slot == 1 ? request->mutable_k() : request->mutable_v();
}

absl::Status UnknownInput(absl::string_view field, absl::string_view name) {
  return absl::InvalidArgumentError(
      absl::StrCat(field, ".name: unknown input \"", name, "\" (this model takes Q, K and V)"));
}

absl::Status CheckAllInputs(const bool seen[3]) {
  for (int i = 0; i < 3; ++i) {
    if (!seen[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("inputs: ", kInputNames[i], " missing (a request carries Q, K and V)"));
    }
  }
  return absl::OkStatus();
}

// Counts the numbers of a (possibly nested) JSON array; INVALID_ARGUMENT for anything else.
absl::Status CountJsonNumbers(const json& data, absl::string_view field, int depth,
                              int64_t* count) {
  if (depth > kMaxJsonDataDepth) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".data: nested too deeply"));
  }
  for (const json& element : data) {
    if (element.is_array()) {
      RETURN_IF_ERROR(CountJsonNumbers(element, field, depth + 1, count));
    } else if (element.is_number()) {
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
      kernels::store_element(base, (*index)++, dtype, static_cast<float>(element.get<double>()));
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

json TensorMetadataJson(absl::string_view name, absl::string_view datatype, int rank) {
  return json{{"name", name}, {"datatype", datatype}, {"shape", std::vector<int64_t>(rank, -1)}};
}

absl::string_view FirstDatatype(const ModelInfo& model) {
  return model.dtypes.empty() ? absl::string_view("FP16") : DatatypeName(model.dtypes.front());
}

}  // namespace

absl::string_view DatatypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT16:
      return "FP16";
    case v1::BFLOAT16:
      return "BF16";
    case v1::FLOAT32:
      return "FP32";
    default:
      return "";
  }
}

absl::StatusOr<v1::DType> ParseDatatype(absl::string_view datatype, absl::string_view field) {
  if (datatype == "FP16") return v1::FLOAT16;
  if (datatype == "BF16") return v1::BFLOAT16;
  if (datatype == "FP32") return v1::FLOAT32;
  return absl::InvalidArgumentError(absl::StrCat(field, ".datatype: \"", datatype,
                                                 "\" is not supported (use FP16, BF16 or FP32)"));
}

absl::Status CheckModel(const ModelInfo& model, absl::string_view name, absl::string_view version) {
  if (name != model.name) {
    return absl::NotFoundError(
        absl::StrCat("unknown model \"", name, "\" (this server serves \"", model.name, "\")"));
  }
  if (!version.empty() && version != model.version) {
    return absl::NotFoundError(absl::StrCat("unknown version \"", version, "\" of model \"", name,
                                            "\" (available: \"", model.version, "\")"));
  }
  return absl::OkStatus();
}

int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      // A request over a configured size limit (the message names the flag) is 413 whatever
      // the server's load; every other RESOURCE_EXHAUSTED (queue full, --max_inflight_bytes,
      // device memory or streams) is overload: 503, retry later.
      return absl::StrContains(status.message(), "--max_tensor_elements") ||
                     absl::StrContains(status.message(), "--max_request_bytes")
                 ? 413
                 : 503;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return 504;
    case absl::StatusCode::kUnimplemented:
      return 501;
    default:
      return 500;
  }
}

std::string ErrorJson(absl::string_view message) {
  return json{{"error", message}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::Status ParseRestInferHeader(absl::string_view text, int64_t binary_bytes,
                                  int64_t max_binary_bytes, RestInferRequest* out) {
  const json body = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) {
    return absl::InvalidArgumentError("request body: not valid JSON");
  }
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
  std::vector<std::pair<std::string*, int64_t>> binary;
  int64_t binary_total = 0;
  for (size_t i = 0; i < inputs->size(); ++i) {
    const json& input = (*inputs)[i];
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
      tensor->add_shape(dim.is_number_unsigned() && dim.get<uint64_t>() > uint64_t(INT64_MAX)
                            ? INT64_MAX
                            : dim.get<int64_t>());
    }
    int64_t binary_size = -1;
    if (auto params = input.find("parameters"); params != input.end()) {
      if (!params->is_object())
        return absl::InvalidArgumentError(field + ".parameters: must be an object");
      if (auto size = params->find("binary_data_size"); size != params->end()) {
        if (!size->is_number_integer() || size->get<int64_t>() < 0 ||
            (size->is_number_unsigned() && size->get<uint64_t>() > uint64_t(INT64_MAX))) {
          return absl::InvalidArgumentError(
              field + ".parameters.binary_data_size: must be an integer >= 0");
        }
        binary_size = size->get<int64_t>();
      }
    }
    const auto data = input.find("data");
    if (binary_size >= 0) {
      if (data != input.end()) {
        return absl::InvalidArgumentError(field + ": both data and binary_data_size given");
      }
      if (binary_size > max_binary_bytes || binary_total > max_binary_bytes - binary_size) {
        return absl::ResourceExhaustedError(
            absl::StrCat("inputs: binary_data_size adds up to more than --max_request_bytes=",
                         max_binary_bytes));
      }
      binary_total += binary_size;
      binary.emplace_back(tensor->mutable_data(), binary_size);
      continue;
    }
    if (data == input.end()) {
      return absl::InvalidArgumentError(field +
                                        ": no data (give \"data\" or parameters.binary_data_size)");
    }
    if (!data->is_array()) {
      return absl::InvalidArgumentError(field + ".data: must be a list of numbers");
    }
    int64_t count = 0;
    RETURN_IF_ERROR(CountJsonNumbers(*data, field, 0, &count));
    const auto kdtype = static_cast<kernels::DType>(dtype);
    tensor->mutable_data()->resize(size_t(count) * kernels::dtype_size(kdtype));
    int64_t index = 0;
    StoreJsonNumbers(*data, kdtype, tensor->mutable_data()->data(), &index);
  }
  RETURN_IF_ERROR(CheckAllInputs(seen));
  if (binary_bytes >= 0 && binary_total != binary_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "inputs: binary_data_size adds up to ", binary_total, " bytes but ", binary_bytes,
        " bytes follow the JSON header (Inference-Header-Content-Length)"));
  }

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
      if (auto params = output.find("parameters"); params != output.end() && params->is_object()) {
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
  ASSIGN_OR_RETURN(out->outputs, ResolveOutputs(requested, options));
  ApplyOptions(options, out->outputs, &out->request);
  // Everything checks out: allocate the binary inputs (bounded by the body's size).
  for (auto& [target, size] : binary) {
    target->resize(size_t(size));
    out->binary_targets.push_back(target);
  }
  return absl::OkStatus();
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
    if (spec.binary) {
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

absl::Status GrpcInferToAttention(inference::ModelInferRequest* request, v1::AttentionRequest* out,
                                  std::vector<OutputSpec>* outputs, int64_t* timeout_us) {
  InferOptions options;
  for (const auto& [key, value] : request->parameters()) {
    RETURN_IF_ERROR(ApplyParameter(key, FromGrpc(value), &options));
  }
  *timeout_us = options.timeout_us;
  const int raw_count = request->raw_input_contents_size();
  if (raw_count > 0 && raw_count != request->inputs_size()) {
    return absl::InvalidArgumentError(absl::StrCat("raw_input_contents: ", raw_count,
                                                   " entries for ", request->inputs_size(),
                                                   " inputs (one per input, in order)"));
  }
  bool seen[3] = {false, false, false};
  for (int i = 0; i < request->inputs_size(); ++i) {
    const inference::ModelInferRequest::InferInputTensor& input = request->inputs(i);
    const std::string field = absl::StrCat("inputs[", i, "]");
    const int slot = InputSlot(input.name());
    if (slot < 0) return UnknownInput(field, input.name());
    if (seen[slot]) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".name: input ", kInputNames[slot], " given twice"));
    }
    seen[slot] = true;
    ASSIGN_OR_RETURN(const v1::DType dtype, ParseDatatype(input.datatype(), field));
    v1::Tensor* tensor = TensorAt(out, slot);
    tensor->set_dtype(dtype);
    tensor->mutable_shape()->CopyFrom(input.shape());
    if (raw_count > 0) {
      if (input.has_contents()) {
        return absl::InvalidArgumentError(
            field + ": contents given together with raw_input_contents (use one)");
      }
      tensor->mutable_data()->swap(*request->mutable_raw_input_contents(i));
    } else if (input.has_contents()) {
      if (dtype != v1::FLOAT32) {
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": ", input.datatype(),
                         " has no typed contents field; send it in raw_input_contents"));
      }
      const auto& values = input.contents().fp32_contents();
      tensor->mutable_data()->assign(reinterpret_cast<const char*>(values.data()),
                                     size_t(values.size()) * sizeof(float));
    } else {
      return absl::InvalidArgumentError(
          field + ": no data (give raw_input_contents or contents.fp32_contents)");
    }
  }
  RETURN_IF_ERROR(CheckAllInputs(seen));
  std::vector<RequestedOutput> requested;
  for (const auto& output : request->outputs()) requested.push_back({output.name(), -1});
  ASSIGN_OR_RETURN(*outputs, ResolveOutputs(requested, options));
  ApplyOptions(options, *outputs, out);
  out->set_request_id(request->id());
  return absl::OkStatus();
}

void AttentionToGrpcInfer(const ModelInfo& model, const std::string& id,
                          const std::vector<OutputSpec>& outputs, v1::AttentionResponse* response,
                          inference::ModelInferResponse* out) {
  out->set_model_name(model.name);
  out->set_model_version(model.version);
  out->set_id(id);
  auto& params = *out->mutable_parameters();
  params["kernel"].set_string_param(response->kernel());
  const v1::Timing& t = response->timing();
  params["queue_us"].set_int64_param(t.queue_us());
  params["h2d_us"].set_int64_param(t.h2d_us());
  params["compute_us"].set_int64_param(t.compute_us());
  params["d2h_us"].set_int64_param(t.d2h_us());
  params["total_us"].set_int64_param(t.total_us());
  for (const OutputSpec& spec : outputs) {
    v1::Tensor* tensor =
        spec.kind == OutputSpec::kOut ? response->mutable_out() : response->mutable_lse();
    auto* output = out->add_outputs();
    output->set_name(spec.kind == OutputSpec::kOut ? "O" : "LSE");
    output->set_datatype(std::string(DatatypeName(tensor->dtype())));
    output->mutable_shape()->CopyFrom(tensor->shape());
    out->add_raw_output_contents()->swap(*tensor->mutable_data());
  }
}

void FillGrpcModelMetadata(const ModelInfo& model, inference::ModelMetadataResponse* out) {
  out->set_name(model.name);
  out->add_versions(model.version);
  out->set_platform(model.platform);
  const std::string datatype(FirstDatatype(model));
  for (const char* name : kInputNames) {
    auto* input = out->add_inputs();
    input->set_name(name);
    input->set_datatype(datatype);
    for (int d = 0; d < 4; ++d) input->add_shape(-1);
  }
  auto* o = out->add_outputs();
  o->set_name("O");
  o->set_datatype(datatype);
  for (int d = 0; d < 4; ++d) o->add_shape(-1);
  auto* lse = out->add_outputs();
  lse->set_name("LSE");
  lse->set_datatype("FP32");
  for (int d = 0; d < 3; ++d) lse->add_shape(-1);
}

const std::vector<std::string>& Extensions() {
  static const std::vector<std::string> extensions = {"binary_tensor_data"};
  return extensions;
}

std::string ServerMetadataJson(const ModelInfo& model) {
  return json{
      {"name", model.server_name}, {"version", model.server_version}, {"extensions", Extensions()}}
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
