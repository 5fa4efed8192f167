// KServe v2 gRPC (inference.GRPCInferenceService): ModelInfer request/response conversion.
#include "edge/grpc/kserve_grpc_convert.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace flashserve::kserve {
namespace {

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
      v.u = uint64_t(v.i);
      v.d = double(v.i);
      v.negative = v.i < 0;
      break;
    case inference::InferParameter::kUint64Param:
      v.type = ParamValue::kInt;
      v.u = p.uint64_param();
      v.i = v.u > uint64_t(std::numeric_limits<int64_t>::max())
                ? std::numeric_limits<int64_t>::max()
                : int64_t(v.u);
      v.d = double(v.u);
      break;
    case inference::InferParameter::kDoubleParam:
      v.type = ParamValue::kDouble;
      v.d = p.double_param();
      break;
    case inference::InferParameter::kStringParam:
      v.type = ParamValue::kString;
      v.s = p.string_param();
      break;
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return v;
}

// The shared_memory_* parameters of one tensor.
template <typename Params>
absl::Status ShmOf(const std::string& field, const Params& params, ShmParams* shm) {
  for (const auto& [key, value] : params) {
    RETURN_IF_ERROR(ApplyShmParameter(field, key, FromGrpc(value), shm).status());
  }
  return CheckShmParams(field, *shm);
}

// Inputs that carry their bytes in raw_input_contents (those not in shared memory).
absl::StatusOr<int> CountRawInputs(const inference::ModelInferRequest& request,
                                   ShmParams* shm_inputs, std::vector<ShmParams>* shm) {
  int in_request = 0;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const std::string field = absl::StrCat("inputs[", i, "]");
    RETURN_IF_ERROR(ShmOf(field, request.inputs(i).parameters(), &(*shm)[size_t(i)]));
    if (!(*shm)[size_t(i)].set()) {
      ++in_request;
    } else if (shm_inputs == nullptr) {
      return absl::InvalidArgumentError(field + ": shared memory is not accepted here");
    }
  }
  const int raw_count = request.raw_input_contents_size();
  if (raw_count > 0 && raw_count != in_request) {
    return absl::InvalidArgumentError(absl::StrCat(
        "raw_input_contents: ", raw_count, " entries for ", in_request,
        " inputs not in shared memory (one per such input, in order)"));
  }
  return raw_count;
}

// FP32 values belong in fp32_contents; values in another typed field were ignored (the tensor
// was then reported as having 0 bytes, or computed from fp32_contents alone).
absl::Status CheckOnlyFp32Contents(const std::string& field,
                                   const inference::InferTensorContents& contents) {
  const std::pair<const char*, int> others[] = {
      {"bool_contents", contents.bool_contents_size()},
      {"int_contents", contents.int_contents_size()},
      {"int64_contents", contents.int64_contents_size()},
      {"uint_contents", contents.uint_contents_size()},
      {"uint64_contents", contents.uint64_contents_size()},
      {"fp64_contents", contents.fp64_contents_size()},
      {"bytes_contents", contents.bytes_contents_size()}};
  for (const auto& [name, count] : others) {
    if (count > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".contents.", name, ": FP32 values go in contents.fp32_contents"));
    }
  }
  return absl::OkStatus();
}

// An input's bytes: its raw_input_contents entry (moved, not copied), else FP32 typed contents.
absl::Status TakeInputData(const std::string& field,
                           const inference::ModelInferRequest::InferInputTensor& input,
                           std::string* raw, v1::Tensor* tensor) {
  if (raw != nullptr) {
    if (input.has_contents()) {
      return absl::InvalidArgumentError(
          field + ": contents given together with raw_input_contents (use one)");
    }
    tensor->mutable_data()->swap(*raw);
    return absl::OkStatus();
  }
  if (!input.has_contents()) {
    return absl::InvalidArgumentError(
        field + ": no data (give raw_input_contents or contents.fp32_contents)");
  }
  if (tensor->dtype() != v1::FLOAT32) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", input.datatype(),
                     " has no typed contents field; send it in raw_input_contents"));
  }
  RETURN_IF_ERROR(CheckOnlyFp32Contents(field, input.contents()));
  const auto& values = input.contents().fp32_contents();
  tensor->mutable_data()->assign(reinterpret_cast<const char*>(values.data()),
                                 size_t(values.size()) * sizeof(float));
  return absl::OkStatus();
}

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::io::CodedInputStream;
using google::protobuf::internal::WireFormatLite;

constexpr int kMaxWireDepth = 32;

// Whether a field arriving as `wire` becomes an object of its own when parsed (null: unknown).
bool ParsesToObject(const FieldDescriptor* field, WireFormatLite::WireType wire) {
  if (field == nullptr) return true;  // kept in the unknown-field set, one entry each
  const auto type = static_cast<WireFormatLite::FieldType>(field->type());
  if (field->message_type() != nullptr || type == WireFormatLite::TYPE_STRING ||
      type == WireFormatLite::TYPE_BYTES) {
    return true;
  }
  if (field->is_repeated() && wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
    return false;  // packed: one field for all the elements
  }
  if (wire != WireFormatLite::WireTypeForFieldType(type)) return true;  // parsed as unknown
  return field->is_repeated() && wire == WireFormatLite::WIRETYPE_VARINT;  // 8 bytes for 2
}

absl::Status TooManyObjects(int64_t max_objects) {
  return absl::InvalidArgumentError(absl::StrCat(
      "request: more than ", max_objects,
      " messages, strings, map entries and unknown fields (a request needs a few dozen)"));
}

// Walks one message to its end (or to `end_group`), taking each object from *left. Returns OK
// at bytes that do not parse: the parse after it refuses them with its own message.
absl::Status CountWireObjects(CodedInputStream* in, const Descriptor* type, int depth,
                              uint32_t end_group, int64_t max_objects, int64_t* left) {
  if (depth > kMaxWireDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("request: nested more than ", kMaxWireDepth, " levels deep"));
  }
  while (true) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0 || tag == end_group) return absl::OkStatus();
    const WireFormatLite::WireType wire = WireFormatLite::GetTagWireType(tag);
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    const FieldDescriptor* field = type == nullptr ? nullptr : type->FindFieldByNumber(number);
    if (ParsesToObject(field, wire) && --*left < 0) return TooManyObjects(max_objects);
    const Descriptor* inner = field == nullptr ? nullptr : field->message_type();
    if (wire == WireFormatLite::WIRETYPE_LENGTH_DELIMITED && inner != nullptr) {
      uint32_t length = 0;
      if (!in->ReadVarint32(&length) || length > uint32_t(INT32_MAX)) return absl::OkStatus();
      const CodedInputStream::Limit limit = in->PushLimit(int(length));
      RETURN_IF_ERROR(CountWireObjects(in, inner, depth + 1, 0, max_objects, left));
      if (!in->Skip(in->BytesUntilLimit())) return absl::OkStatus();
      in->PopLimit(limit);
    } else if (wire == WireFormatLite::WIRETYPE_START_GROUP) {
      // A group's fields are parsed one by one too (an unknown group's into the unknown set).
      const uint32_t end = WireFormatLite::MakeTag(number, WireFormatLite::WIRETYPE_END_GROUP);
      RETURN_IF_ERROR(CountWireObjects(in, inner, depth + 1, end, max_objects, left));
    } else if (wire == WireFormatLite::WIRETYPE_END_GROUP ||
               !WireFormatLite::SkipField(in, tag)) {
      return absl::OkStatus();
    }
  }
}

}  // namespace

absl::Status CheckWireObjects(google::protobuf::io::ZeroCopyInputStream* input,
                              const Descriptor& type, int64_t max_objects) {
  CodedInputStream in(input);
  in.SetTotalBytesLimit(INT32_MAX);
  int64_t left = max_objects;
  return CountWireObjects(&in, &type, 0, 0, max_objects, &left);
}

absl::Status GrpcInferToAttention(inference::ModelInferRequest* request, v1::AttentionRequest* out,
                                  std::vector<OutputSpec>* outputs, int64_t* timeout_us,
                                  ShmParams* shm_inputs) {
  InferOptions options;
  for (const auto& [key, value] : request->parameters()) {
    RETURN_IF_ERROR(ApplyParameter(key, FromGrpc(value), &options));
  }
  *timeout_us = options.timeout_us;
  std::vector<ShmParams> shm(size_t(request->inputs_size()));
  ASSIGN_OR_RETURN(const int raw_count, CountRawInputs(*request, shm_inputs, &shm));
  int raw_next = 0;
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
    if (shm[size_t(i)].set()) {
      if (input.has_contents()) {
        return absl::InvalidArgumentError(
            field + ": contents given together with shared_memory_region (use one)");
      }
      shm_inputs[slot] = shm[size_t(i)];
      continue;
    }
    std::string* raw = raw_count > 0 ? request->mutable_raw_input_contents(raw_next++) : nullptr;
    RETURN_IF_ERROR(TakeInputData(field, input, raw, tensor));
  }
  RETURN_IF_ERROR(CheckAllInputs(seen));
  std::vector<RequestedOutput> requested;
  for (int i = 0; i < request->outputs_size(); ++i) {
    const auto& output = request->outputs(i);
    RequestedOutput r{output.name(), -1, {}};
    RETURN_IF_ERROR(ShmOf(absl::StrCat("outputs[", i, "]"), output.parameters(), &r.shm));
    r.classification = output.parameters().contains("classification");
    if (r.shm.set() && shm_inputs == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("outputs[", i, "]: shared memory is not accepted here"));
    }
    requested.push_back(std::move(r));
  }
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
    std::string* raw = out->add_raw_output_contents();
    // An output in a region is there already; the runtime also leaves a copy in the response
    // when the region's address did not suit the kernels (written beside, then copied): sent,
    // that copy doubled the answer, and a large one was refused by the client's message limit.
    if (!spec.shm.set()) raw->swap(*tensor->mutable_data());
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
}  // namespace flashserve::kserve
