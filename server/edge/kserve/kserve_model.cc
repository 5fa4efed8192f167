// The KServe v2 model flashserve presents, and the request conversions both edges share.
#include "edge/kserve/kserve_model.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace flashserve::kserve {

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
    // A positive scale below fp32's range becomes 0, which validation reported as "got 0".
    if (value.d > 0 && static_cast<float>(value.d) == 0.f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters.softmax_scale: ", value.d, " is below float32's range (it would be 0)"));
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

absl::StatusOr<std::vector<OutputSpec>> ResolveOutputs(
    const std::vector<RequestedOutput>& requested, const InferOptions& options) {
  std::vector<OutputSpec> outputs;
  if (requested.empty()) {
    outputs.push_back({OutputSpec::kOut, options.binary_data_output, {}});
    if (options.return_lse) outputs.push_back({OutputSpec::kLse, options.binary_data_output, {}});
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
    if (r.classification) {
      return absl::InvalidArgumentError(absl::StrCat(
          "outputs[", i, "].parameters.classification: not supported (O and LSE are tensors)"));
    }
    seen[spec.kind] = true;
    spec.binary = r.binary < 0 ? options.binary_data_output : r.binary == 1;
    spec.shm = r.shm;
    outputs.push_back(spec);
  }
  if (options.return_lse && !seen[OutputSpec::kLse]) {
    return absl::InvalidArgumentError(
        "parameters.return_lse: true, but the outputs named leave LSE out (name it among them, or "
        "name no outputs)");
  }
  return outputs;
}

absl::StatusOr<bool> ApplyShmParameter(absl::string_view field, absl::string_view key,
                                       const ParamValue& value, ShmParams* shm) {
  if (key == "shared_memory_region") {
    if (value.type != ParamValue::kString || value.s.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".parameters.shared_memory_region: must be a region's name"));
    }
    shm->region = value.s;
    return true;
  }
  const bool offset = key == "shared_memory_offset";
  if (!offset && key != "shared_memory_byte_size") return false;
  if (value.type != ParamValue::kInt || value.negative) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".parameters.", key, ": must be an integer >= 0"));
  }
  // Sizes are checked as int64 later: one past it is refused here, named as sent. An offset is
  // kept as sent (uint64, as the native API's): the region's range check then names it.
  if (!offset && value.u > uint64_t(INT64_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".parameters.", key, ": ", value.u,
                                                   " does not fit a signed 64-bit integer"));
  }
  (offset ? shm->offset : shm->byte_size) = value.u;
  (offset ? shm->has_offset : shm->has_byte_size) = true;
  return true;
}

absl::Status CheckShmParams(absl::string_view field, const ShmParams& shm) {
  if (!shm.set() && (shm.has_offset || shm.has_byte_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".parameters: shared_memory_offset/byte_size without shared_memory_region"));
  }
  if (shm.set() && !shm.has_byte_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".parameters.shared_memory_byte_size: missing (with a region)"));
  }
  return absl::OkStatus();
}

namespace {

bool WantsLse(const std::vector<OutputSpec>& outputs) {
  for (const OutputSpec& o : outputs) {
    if (o.kind == OutputSpec::kLse) return true;
  }
  return false;
}

}  // namespace

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
absl::string_view FirstDatatype(const ModelInfo& model) {
  return model.dtypes.empty() ? absl::string_view("FP16") : DatatypeName(model.dtypes.front());
}
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
std::vector<std::string> Extensions(bool client_shm, bool cuda_backend) {
  std::vector<std::string> extensions = {"binary_tensor_data"};
  if (client_shm) extensions.push_back("system_shared_memory");
  if (client_shm && cuda_backend) extensions.push_back("cuda_shared_memory");
  return extensions;
}
}  // namespace flashserve::kserve
