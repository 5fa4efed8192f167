// KServe v2 / Open Inference Protocol conversions, without a server.
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "edge/grpc/kserve_grpc_convert.h"
#include "edge/http/kserve_json.h"
#include "edge/kserve/kserve_model.h"
#include "flashserve/kernels/float_convert.h"
#include "gmock/gmock.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace flashserve::kserve {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kMax = int64_t{1} << 30;

json Input(const char* name, const char* datatype, std::vector<int64_t> shape) {
  return json{{"name", name}, {"datatype", datatype}, {"shape", shape}};
}

// A JSON-data request: Q [1,2,1,2] and K, V [1,3,1,2] in `datatype`.
json JsonRequest(const char* datatype = "FP32") {
  json q = Input("Q", datatype, {1, 2, 1, 2});
  q["data"] = {0.5, -1.0, 2.0, 0.25};
  json k = Input("K", datatype, {1, 3, 1, 2});
  k["data"] = {{1, 2}, {3, 4}, {5, 6}};  // nested lists are flattened row-major
  json v = Input("V", datatype, {1, 3, 1, 2});
  v["data"] = {1, 2, 3, 4, 5, 6};
  return json{{"inputs", {q, k, v}}};
}

absl::Status Parse(const json& body, RestInferRequest* out, int64_t binary_bytes = 0) {
  return ParseRestInferHeader(body.dump(), binary_bytes, kMax, out);
}

TEST(KServeConvertTest, Datatypes) {
  EXPECT_EQ(*ParseDatatype("FP16", "x"), v1::FLOAT16);
  EXPECT_EQ(*ParseDatatype("BF16", "x"), v1::BFLOAT16);
  EXPECT_EQ(*ParseDatatype("FP32", "x"), v1::FLOAT32);
  absl::StatusOr<v1::DType> bad = ParseDatatype("FP64", "inputs[1]");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("inputs[1].datatype"));
  EXPECT_EQ(DatatypeName(v1::BFLOAT16), "BF16");
}

TEST(KServeConvertTest, HttpStatusForEveryCode) {
  EXPECT_EQ(HttpStatusFor(absl::OkStatus()), 200);
  EXPECT_EQ(HttpStatusFor(absl::InvalidArgumentError("q.shape")), 400);
  EXPECT_EQ(HttpStatusFor(absl::NotFoundError("model")), 404);
  EXPECT_EQ(HttpStatusFor(absl::UnauthenticatedError("token")), 401);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError(
                "q: 70000 elements exceed --max_tensor_elements=65536")),
            413);
  EXPECT_EQ(HttpStatusFor(
                absl::ResourceExhaustedError("request body exceeds --max_request_bytes=1048576")),
            413);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError(
                "request body exceeds 64 KiB (a shared-memory call's body)=65536")),
            413);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError("queue full (64 waiting); retry later")),
            503);
  EXPECT_EQ(HttpStatusFor(absl::ResourceExhaustedError(
                "server busy: 10 tensor bytes in flight + 20 exceed --max_inflight_bytes=16")),
            503);
  EXPECT_EQ(HttpStatusFor(absl::UnavailableError("shutting down")), 503);
  EXPECT_EQ(HttpStatusFor(absl::DeadlineExceededError("late")), 504);
  EXPECT_EQ(HttpStatusFor(absl::InternalError("bug")), 500);
}

TEST(KServeConvertTest, ErrorJsonEscapes) {
  EXPECT_EQ(json::parse(ErrorJson("unknown model \"x\"\n"))["error"], "unknown model \"x\"\n");
}

TEST(KServeConvertTest, CheckModel) {
  ModelInfo model;
  model.name = "attn";
  EXPECT_TRUE(CheckModel(model, "attn", "").ok());
  EXPECT_TRUE(CheckModel(model, "attn", "1").ok());
  EXPECT_EQ(CheckModel(model, "attention", "").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(CheckModel(model, "attn", "2").code(), absl::StatusCode::kNotFound);
}

TEST(KServeConvertTest, JsonDataAndParameters) {
  json body = JsonRequest("FP16");
  body["id"] = "req-7";
  body["parameters"] = {{"causal", true}, {"softmax_scale", 0.125}, {"priority", 3}};
  RestInferRequest r;
  ASSERT_TRUE(Parse(body, &r).ok());
  EXPECT_EQ(r.id, "req-7");
  EXPECT_EQ(r.request.request_id(), "req-7");
  EXPECT_TRUE(r.request.causal());
  ASSERT_TRUE(r.request.has_softmax_scale());
  EXPECT_FLOAT_EQ(r.request.softmax_scale(), 0.125f);
  EXPECT_FALSE(r.request.return_lse());
  EXPECT_TRUE(r.binary_targets.empty());
  EXPECT_EQ(r.request.q().dtype(), v1::FLOAT16);
  ASSERT_EQ(r.request.k().data().size(), 6u * 2);
  uint16_t k[6];
  std::memcpy(k, r.request.k().data().data(), sizeof(k));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(kernels::half_to_float(k[i]), float(i + 1));
  ASSERT_EQ(r.outputs.size(), 1u);  // O only, as JSON
  EXPECT_EQ(r.outputs[0].kind, OutputSpec::kOut);
  EXPECT_FALSE(r.outputs[0].binary);
}

TEST(KServeConvertTest, ReturnLseOrRequestedLseAddsLse) {
  json body = JsonRequest();
  body["parameters"] = {{"return_lse", true}, {"binary_data_output", true}};
  RestInferRequest r;
  ASSERT_TRUE(Parse(body, &r).ok());
  EXPECT_TRUE(r.request.return_lse());
  ASSERT_EQ(r.outputs.size(), 2u);
  EXPECT_EQ(r.outputs[1].kind, OutputSpec::kLse);
  EXPECT_TRUE(r.outputs[0].binary && r.outputs[1].binary);

  json explicit_outputs = JsonRequest();
  explicit_outputs["outputs"] = {{{"name", "LSE"}},
                                 {{"name", "O"}, {"parameters", {{"binary_data", true}}}}};
  RestInferRequest e;
  ASSERT_TRUE(Parse(explicit_outputs, &e).ok());
  EXPECT_TRUE(e.request.return_lse());
  ASSERT_EQ(e.outputs.size(), 2u);
  EXPECT_EQ(e.outputs[0].kind, OutputSpec::kLse);
  EXPECT_FALSE(e.outputs[0].binary);
  EXPECT_TRUE(e.outputs[1].binary);
}

// Outputs named beside return_lse, or with parameters the model cannot honour, are refused: they
// were dropped silently (LSE left out; raw tensors for a classification).
TEST(KServeConvertTest, OutputsThatCannotBeHonouredAreRefused) {
  json lse_left_out = JsonRequest();
  lse_left_out["parameters"] = {{"return_lse", true}};
  lse_left_out["outputs"] = {{{"name", "O"}}};
  RestInferRequest r;
  absl::Status s = Parse(lse_left_out, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("return_lse"));
  json classification = JsonRequest();
  classification["outputs"] = {{{"name", "O"}, {"parameters", {{"classification", 3}}}}};
  s = Parse(classification, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("outputs[0].parameters.classification"));
  json not_an_object = JsonRequest();
  not_an_object["outputs"] = {{{"name", "O"}, {"parameters", "x"}}};
  s = Parse(not_an_object, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("outputs[0].parameters: must be an object"));
}

// JSON numbers round once, from the double, to FP16 / BF16 (through a float they rounded twice:
// 1.0004883 became 1.0 in FP16, and a value just under FP16's overflow was refused as out of
// range).
TEST(KServeConvertTest, JsonNumbersRoundOnceToHalfTypes) {
  struct Case {
    const char* datatype;
    double value;
    uint16_t bits;
  };
  for (const Case& c : {Case{"FP16", 1.0004883, 0x3C01}, Case{"FP16", 65519.999999999, 0x7BFF},
                        Case{"FP16", -1.0004883, 0xBC01}, Case{"BF16", 1.0039063, 0x3F81},
                        Case{"FP16", 1.0, 0x3C00}, Case{"BF16", 0.5, 0x3F00}}) {
    SCOPED_TRACE(std::string(c.datatype) + " " + std::to_string(c.value));
    json body = JsonRequest(c.datatype);
    body["inputs"][0]["data"] = {c.value, 0.0, 0.0, 0.0};
    RestInferRequest r;
    ASSERT_TRUE(Parse(body, &r).ok()) << Parse(body, &r);
    uint16_t got = 0;
    std::memcpy(&got, r.request.q().data().data(), sizeof(got));
    EXPECT_EQ(got, c.bits);
  }
}

TEST(KServeConvertTest, BinaryInputsAreSizedInInputOrder) {
  json v = Input("V", "FP16", {1, 3, 1, 2});
  v["parameters"] = {{"binary_data_size", 12}};
  json q = Input("Q", "FP16", {1, 2, 1, 2});
  q["parameters"] = {{"binary_data_size", 8}};
  json k = Input("K", "FP16", {1, 3, 1, 2});
  k["data"] = {1, 2, 3, 4, 5, 6};
  RestInferRequest r;
  ASSERT_TRUE(Parse(json{{"inputs", {v, k, q}}}, &r, 20).ok());
  ASSERT_EQ(r.binary_targets.size(), 2u);
  EXPECT_EQ(r.binary_targets[0], r.request.mutable_v()->mutable_data());
  EXPECT_EQ(r.binary_targets[1], r.request.mutable_q()->mutable_data());
  EXPECT_EQ(r.request.v().data().size(), 12u);
  EXPECT_EQ(r.request.q().data().size(), 8u);

  RestInferRequest mismatch;
  absl::Status s = Parse(json{{"inputs", {v, k, q}}}, &mismatch, 21);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("binary_data_size adds up to 20 bytes but 21"));
  EXPECT_TRUE(mismatch.request.q().data().empty()) << "nothing allocated for a bad request";

  RestInferRequest too_big;
  s = ParseRestInferHeader(json{{"inputs", {v, k, q}}}.dump(), -1, 16, &too_big);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(HttpStatusFor(s), 413);
}

TEST(KServeConvertTest, MalformedRequestsNameTheField) {
  struct Case {
    std::function<void(json&)> edit;
    const char* message;
  };
  const Case cases[] = {
      {[](json& b) { b["inputs"][1]["name"] = "X"; }, "inputs[1].name: unknown input \"X\""},
      {[](json& b) { b["inputs"][1]["name"] = "Q"; }, "input Q given twice"},
      {[](json& b) { b["inputs"].erase(2); }, "inputs: V missing"},
      {[](json& b) { b["inputs"][0]["datatype"] = "INT8"; }, "inputs[0].datatype"},
      {[](json& b) { b["inputs"][0].erase("data"); }, "inputs[0]: no data"},
      {[](json& b) {
         b["inputs"][0]["data"] = {1, "a"};
       },
       "inputs[0].data: elements must be numbers"},
      {[](json& b) {
         b["inputs"][0]["shape"] = {1, 2.5};
       },
       "inputs[0].shape"},
      {[](json& b) {
         b["inputs"][0]["shape"] = {1, 2, 1, std::numeric_limits<uint64_t>::max()};
       },
       "inputs[0].shape: 18446744073709551615 does not fit a signed 64-bit integer"},
      {[](json& b) {
         b["inputs"][0]["parameters"] = {{"binary_data_size", 16}};
       },
       "both data and binary_data_size"},
      {[](json& b) {
         b["parameters"] = {{"causal", "yes"}};
       },
       "parameters.causal: must be a boolean"},
      {[](json& b) {
         b["parameters"] = {{"softmax_scale", true}};
       },
       "parameters.softmax_scale"},
      {[](json& b) {
         b["parameters"] = {{"softmax_scale", 1e-46}};
       },
       "parameters.softmax_scale: 1e-46 is below float32's range"},
      {[](json& b) {
         b["outputs"] = {{{"name", "P"}}};
       },
       "outputs[0].name: unknown output \"P\""},
      {[](json& b) { b["id"] = 5; }, "id: must be a string"},
  };
  for (const Case& c : cases) {
    json body = JsonRequest();
    c.edit(body);
    RestInferRequest r;
    absl::Status s = Parse(body, &r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
  RestInferRequest r;
  EXPECT_THAT(ParseRestInferHeader("{\"inputs\": [", 0, kMax, &r).message(),
              HasSubstr("not valid JSON"));
}

// nlohmann keeps a repeated key's last value; a proxy in front may read the first. Refused at
// any depth, escaped spellings of one key included; the same key in sibling objects is fine.
TEST(KServeConvertTest, DuplicateJsonKeysAreRefused) {
  const std::string inputs = JsonRequest()["inputs"].dump();  // [{"data":...,"datatype":"FP32",...
  const std::string q_rest = inputs.substr(2);                // Q's members on, then K and V
  struct Case {
    std::string body;
    const char* key;
  };
  const Case cases[] = {
      {"{\"inputs\":[],\"inputs\":" + inputs + "}", "inputs"},
      {"{\"inputs\":[{\"datatype\":\"FP16\"," + q_rest + "}", "datatype"},
      {"{\"inputs\":[{\"data\\u0074ype\":\"FP16\"," + q_rest + "}", "datatype"},
      {"{\"parameters\":{\"causal\":true,\"causal\":false},\"inputs\":" + inputs + "}", "causal"},
  };
  RestInferRequest once;  // the same bodies with each key once
  ASSERT_TRUE(ParseRestInferHeader("{\"inputs\":[{" + q_rest + "}", 0, kMax, &once).ok());
  for (const Case& c : cases) {
    RestInferRequest r;
    const absl::Status s = ParseRestInferHeader(c.body, 0, kMax, &r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_THAT(s.message(),
                HasSubstr(absl::StrCat("duplicate key \"", c.key, "\" in a JSON object")))
        << c.body;
  }
  json parsed;
  EXPECT_TRUE(
      ParseJsonUniqueKeys(R"({"a":[{"k":1},{"k":2}],"b":{"a":{"a":1}},"k":3})", &parsed).ok());
  EXPECT_EQ(parsed["a"][1]["k"], 2);
  const std::string long_key(1000, 'x');
  absl::Status s = ParseJsonUniqueKeys("{\"" + long_key + "\":1,\"" + long_key + "\":2}", &parsed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(s.message().size(), 200u) << "the key is shown clipped";
  EXPECT_THAT(ParseJsonUniqueKeys("{\"a\":", &parsed).message(), HasSubstr("not valid JSON"));
  EXPECT_TRUE(parsed.is_discarded());
}

// A body that does not parse says where and why: 1e400 is JSON text no double holds, which a
// bare "not valid JSON" hid; the reason quotes the client's token, clipped.
TEST(KserveJsonText, ParseErrorsSayWhereAndWhy) {
  json parsed;
  absl::Status s = ParseJsonUniqueKeys(R"({"parameters":{"scale":1e400}})", &parsed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not valid JSON at byte "));
  EXPECT_THAT(s.message(), HasSubstr("number overflow parsing '1e400'"));
  EXPECT_THAT(s.message(), Not(HasSubstr("json.exception")));
  EXPECT_TRUE(parsed.is_discarded());
  s = ParseJsonUniqueKeys(R"({"a": tru})", &parsed);
  EXPECT_THAT(s.message(), HasSubstr("not valid JSON: parse error at line 1, column 10: "));
  EXPECT_THAT(s.message(), HasSubstr("invalid literal"));
  const std::string long_number = "{\"a\":1" + std::string(5000, '0') + "}";
  s = ParseJsonUniqueKeys(long_number, &parsed);
  EXPECT_THAT(s.message(), HasSubstr("number overflow parsing '1000"));
  EXPECT_LT(s.message().size(), 260u) << "the client's token is shown clipped: " << s.message();
}

// nlohmann's lexer ends the input at a NUL: a valid body with junk after one was accepted.
TEST(KserveJsonText, ANulByteIsRefusedNotTakenForTheEnd) {
  json parsed;
  const std::string body = std::string(R"({"inputs":[]})") + '\0' + " not json {{{";
  const absl::Status s = ParseJsonUniqueKeys(body, &parsed);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("not valid JSON at byte 14: a NUL byte"));
  EXPECT_TRUE(parsed.is_discarded());
  EXPECT_TRUE(ParseJsonUniqueKeys(R"({"a":"\u0000"})", &parsed).ok());  // escaped in a string
}

// nlohmann's callback parser (used until session 42) rescanned the parent container at every
// object's end: 400k objects in one array took ~20 s there (600 KB: 5 s on a listener thread).
TEST(KServeConvertTest, ParsingManyObjectsIsLinear) {
  constexpr int kObjects = 400000;
  std::string text = "{\"junk\":[";
  for (int i = 0; i < kObjects; ++i) absl::StrAppend(&text, i == 0 ? "" : ",", "{}");
  text += "]}";
  json parsed;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(ParseJsonUniqueKeys(text, &parsed).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(parsed["junk"].size(), size_t{kObjects});
  EXPECT_LT(seconds, 3.0) << "quadratic again? (linear: ~0.05 s here, 10x that under ASan)";
  // Keys of objects side by side, and objects in objects, are tracked per object.
  EXPECT_TRUE(ParseJsonUniqueKeys(R"({"a":{"x":1},"b":{"x":2},"c":{"d":{"x":3}}})", &parsed).ok());
  EXPECT_THAT(ParseJsonUniqueKeys(R"({"a":{"x":1,"y":{"x":2},"x":3}})", &parsed).message(),
              HasSubstr("duplicate key \"x\""));
}

TEST(KServeConvertTest, ScanJsonBoundsObjectsAndStrings) {
  std::string objects = "[";
  for (int64_t i = 0; i <= kMaxJsonObjects; ++i) absl::StrAppend(&objects, i == 0 ? "" : ",", "{}");
  objects += "]";
  EXPECT_THAT(ScanJson(objects, kMax).message(), HasSubstr("JSON objects"));
  std::string strings = "[";
  for (int64_t i = 0; i <= kMaxJsonStrings; ++i)
    absl::StrAppend(&strings, i == 0 ? "" : ",", "\"\"");
  strings += "]";
  EXPECT_THAT(ScanJson(strings, kMax).message(), HasSubstr("JSON strings"));
  // At the caps: accepted; a quote inside a string is not a string.
  EXPECT_TRUE(ScanJson(objects.substr(0, objects.size() - 4) + "]", kMax).ok());
  EXPECT_TRUE(ScanJson(R"(["a\"b", "{[,"])", kMax).ok());
}

TEST(KServeConvertTest, RestResponseJsonAndBinary) {
  RestInferRequest r;
  r.id = "abc";
  r.has_id = true;
  r.outputs = {{OutputSpec::kOut, true, {}}, {OutputSpec::kLse, false, {}}};
  v1::AttentionResponse response;
  response.mutable_out()->set_dtype(v1::BFLOAT16);
  for (int64_t d : {1, 1, 1, 2}) response.mutable_out()->add_shape(d);
  response.mutable_out()->set_data(std::string("\x80\x3f\x00\x40", 4));
  response.mutable_lse()->set_dtype(v1::FLOAT32);
  for (int64_t d : {1, 1, 1}) response.mutable_lse()->add_shape(d);
  const float lse = -std::numeric_limits<float>::infinity();
  response.mutable_lse()->set_data(std::string(reinterpret_cast<const char*>(&lse), 4));
  response.set_kernel("k1");

  ModelInfo model;
  RestInferResponse out = BuildRestInferResponse(model, r, response);
  const json header = json::parse(out.header);
  EXPECT_EQ(header["id"], "abc");
  EXPECT_EQ(header["model_name"], "attention");
  EXPECT_EQ(header["parameters"]["kernel"], "k1");
  EXPECT_EQ(header["outputs"][0]["datatype"], "BF16");
  EXPECT_EQ(header["outputs"][0]["parameters"]["binary_data_size"], 4);
  EXPECT_FALSE(header["outputs"][0].contains("data"));
  EXPECT_TRUE(header["outputs"][1]["data"][0].is_null()) << "-inf has no JSON number";
  ASSERT_EQ(out.binary.size(), 1u);
  EXPECT_EQ(out.binary[0].data(), response.out().data().data()) << "no copy of the output";
  EXPECT_EQ(out.binary_bytes(), 4);
}

TEST(KServeConvertTest, GrpcRawContentsAreMovedNotCopied) {
  inference::ModelInferRequest request;
  request.set_model_name("attention");
  request.set_id("g1");
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  (*request.mutable_parameters())["softmax_scale"].set_double_param(0.5);
  const char* names[3] = {"K", "Q", "V"};
  for (const char* name : names) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("BF16");
    for (int64_t d : {1, 4, 1, 8}) input->add_shape(d);
    request.add_raw_input_contents(std::string(64, name[0]));
  }
  const char* k_bytes = request.raw_input_contents(0).data();
  v1::AttentionRequest out;
  std::vector<OutputSpec> outputs;
  int64_t timeout_us = -1;
  ASSERT_TRUE(GrpcInferToAttention(&request, &out, &outputs, &timeout_us).ok());
  EXPECT_EQ(out.k().data(), std::string(64, 'K'));
  EXPECT_EQ(out.q().data(), std::string(64, 'Q'));
  EXPECT_EQ(out.k().data().data(), k_bytes) << "raw bytes moved, not copied";
  EXPECT_EQ(out.q().dtype(), v1::BFLOAT16);
  EXPECT_TRUE(out.causal());
  EXPECT_FLOAT_EQ(out.softmax_scale(), 0.5f);
  EXPECT_EQ(out.request_id(), "g1");
  EXPECT_EQ(timeout_us, 0);
  ASSERT_EQ(outputs.size(), 1u);

  v1::AttentionResponse response;
  response.mutable_out()->set_dtype(v1::BFLOAT16);
  for (int64_t d : {1, 4, 1, 8}) response.mutable_out()->add_shape(d);
  response.mutable_out()->set_data(std::string(64, 'O'));
  const char* o_bytes = response.out().data().data();
  inference::ModelInferResponse grpc_response;
  AttentionToGrpcInfer(ModelInfo(), "g1", outputs, &response, &grpc_response);
  EXPECT_EQ(grpc_response.id(), "g1");
  ASSERT_EQ(grpc_response.outputs_size(), 1);
  EXPECT_EQ(grpc_response.outputs(0).name(), "O");
  EXPECT_EQ(grpc_response.outputs(0).datatype(), "BF16");
  EXPECT_EQ(grpc_response.outputs(0).shape_size(), 4);
  ASSERT_EQ(grpc_response.raw_output_contents_size(), 1);
  EXPECT_EQ(grpc_response.raw_output_contents(0).data(), o_bytes) << "moved, not copied";
}

TEST(KServeConvertTest, GrpcTypedContentsAndErrors) {
  inference::ModelInferRequest request;
  for (const char* name : {"Q", "K", "V"}) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t d : {1, 1, 1, 2}) input->add_shape(d);
    input->mutable_contents()->add_fp32_contents(1.5f);
    input->mutable_contents()->add_fp32_contents(-2.f);
  }
  request.add_outputs()->set_name("LSE");
  v1::AttentionRequest out;
  std::vector<OutputSpec> outputs;
  int64_t timeout_us = 0;
  ASSERT_TRUE(GrpcInferToAttention(&request, &out, &outputs, &timeout_us).ok());
  float v[2];
  std::memcpy(v, out.v().data().data(), 8);
  EXPECT_EQ(v[0], 1.5f);
  EXPECT_EQ(v[1], -2.f);
  EXPECT_TRUE(out.return_lse());

  inference::ModelInferRequest fp16 = request;
  fp16.mutable_inputs(0)->set_datatype("FP16");
  v1::AttentionRequest ignored;
  absl::Status s = GrpcInferToAttention(&fp16, &ignored, &outputs, &timeout_us);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("raw_input_contents"));

  inference::ModelInferRequest short_raw = request;
  short_raw.add_raw_input_contents("12345678");
  s = GrpcInferToAttention(&short_raw, &ignored, &outputs, &timeout_us);
  EXPECT_THAT(s.message(), HasSubstr("raw_input_contents: 1 entries for 3 inputs"));

  inference::ModelInferRequest bad_param = request;
  (*bad_param.mutable_parameters())["return_lse"].set_string_param("yes");
  s = GrpcInferToAttention(&bad_param, &ignored, &outputs, &timeout_us);
  EXPECT_THAT(s.message(), HasSubstr("parameters.return_lse"));

  // FP32 values in another typed field were ignored: 0 bytes ("q.data: expected 8 bytes, got
  // 0"), or, beside fp32_contents, dropped without a word.
  for (bool with_fp32 : {false, true}) {
    inference::ModelInferRequest other_field = request;
    auto* contents = other_field.mutable_inputs(1)->mutable_contents();
    if (!with_fp32) contents->clear_fp32_contents();
    contents->add_fp64_contents(1.5);
    contents->add_fp64_contents(-2.0);
    s = GrpcInferToAttention(&other_field, &ignored, &outputs, &timeout_us);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(),
                HasSubstr("inputs[1].contents.fp64_contents: FP32 values go in "
                          "contents.fp32_contents"));
  }
}

TEST(KServeConvertTest, Metadata) {
  ModelInfo model;
  model.name = "attn";
  model.dtypes = {v1::BFLOAT16, v1::FLOAT16};
  const json m = json::parse(ModelMetadataJson(model));
  EXPECT_EQ(m["name"], "attn");
  EXPECT_EQ(m["versions"], json::array({"1"}));
  ASSERT_EQ(m["inputs"].size(), 3u);
  EXPECT_EQ(m["inputs"][0]["datatype"], "BF16");
  EXPECT_EQ(m["inputs"][0]["shape"], json::array({-1, -1, -1, -1}));
  EXPECT_EQ(m["outputs"][1]["name"], "LSE");
  inference::ModelMetadataResponse g;
  FillGrpcModelMetadata(model, &g);
  EXPECT_EQ(g.inputs_size(), 3);
  EXPECT_EQ(g.outputs(1).shape_size(), 3);
  model.extensions = Extensions(/*client_shm=*/true, /*cuda_backend=*/false);
  const json s = json::parse(ServerMetadataJson(model));
  EXPECT_EQ(s["extensions"], json::array({"binary_tensor_data", "system_shared_memory"}));
}

// Only the extensions this server can serve: shared memory needs --allow_client_shm, CUDA regions
// the CUDA backend too (a client that picked its transport from the list was refused after).
TEST(KServeConvertTest, ExtensionsAreThoseThisServerServes) {
  using List = std::vector<std::string>;
  EXPECT_EQ(Extensions(false, false), (List{"binary_tensor_data"}));
  EXPECT_EQ(Extensions(false, true), (List{"binary_tensor_data"}));
  EXPECT_EQ(Extensions(true, false), (List{"binary_tensor_data", "system_shared_memory"}));
  EXPECT_EQ(Extensions(true, true),
            (List{"binary_tensor_data", "system_shared_memory", "cuda_shared_memory"}));
}

// Triton's shared-memory parameters on inputs and outputs (REST): a referenced input has no data
// and its byte size is what validation checks; bad combinations are refused naming the tensor.
TEST(KServeConvertTest, RestSharedMemoryReferences) {
  json body = JsonRequest();
  body["inputs"][1].erase("data");
  body["inputs"][1]["parameters"] = {{"shared_memory_region", "r1"},
                                     {"shared_memory_offset", 64},
                                     {"shared_memory_byte_size", 24}};
  body["outputs"] = {{{"name", "O"},
                      {"parameters", {{"shared_memory_region", "out"},
                                      {"shared_memory_byte_size", 16}}}}};
  RestInferRequest r;
  ValidationLimits limits;
  limits.dtypes = {kernels::DType::kFloat32};
  limits.max_head_dim = 256;
  RestHeaderChecks checks;
  checks.validation = &limits;
  const absl::Status parsed = ParseRestInferHeader(body.dump(), 0, kMax, &r, checks);
  ASSERT_TRUE(parsed.ok()) << parsed;
  EXPECT_EQ(r.shm_inputs[1].region, "r1");
  EXPECT_EQ(r.shm_inputs[1].offset, 64u);
  EXPECT_EQ(r.shm_inputs[1].byte_size, 24u);
  EXPECT_FALSE(r.shm_inputs[0].set());
  EXPECT_TRUE(r.request.k().data().empty());
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_EQ(r.outputs[0].shm.region, "out");

  body["inputs"][1]["parameters"]["shared_memory_byte_size"] = 20;  // K is 24 bytes
  RestInferRequest wrong;
  absl::Status s = ParseRestInferHeader(body.dump(), 0, kMax, &wrong, checks);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  auto refused = [&](json edit, const char* fragment) {
    json b = JsonRequest();
    b["inputs"][0]["parameters"] = edit;
    RestInferRequest out;
    absl::Status st = Parse(b, &out);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << edit.dump();
    EXPECT_THAT(st.message(), HasSubstr(fragment)) << edit.dump();
  };
  refused({{"shared_memory_region", "r"}, {"shared_memory_byte_size", 16}}, "inputs[0]: data given");
  refused({{"shared_memory_region", "r"}}, "shared_memory_byte_size: missing");
  refused({{"shared_memory_byte_size", 16}}, "without shared_memory_region");
  refused({{"shared_memory_region", 5}, {"shared_memory_byte_size", 16}}, "region's name");
  refused({{"shared_memory_region", "r"}, {"shared_memory_byte_size", -1}}, "integer >= 0");
  refused({{"shared_memory_region", "r"}, {"shared_memory_byte_size", 16},
           {"shared_memory_offset", -8}}, "shared_memory_offset: must be an integer >= 0");
  // Past int64: an offset is kept as sent (it was INT64_MAX, which the region's range error then
  // showed); a size is refused, named as sent.
  json huge = JsonRequest();
  huge["inputs"][0].erase("data");
  huge["inputs"][0]["parameters"] = {
      {"shared_memory_region", "r"},
      {"shared_memory_byte_size", 16},
      {"shared_memory_offset", std::numeric_limits<uint64_t>::max()}};
  RestInferRequest as_sent;
  ASSERT_TRUE(Parse(huge, &as_sent).ok());
  EXPECT_EQ(as_sent.shm_inputs[0].offset, std::numeric_limits<uint64_t>::max());
  refused({{"shared_memory_region", "r"}, {"shared_memory_byte_size", uint64_t{1} << 63}},
          "inputs[0].parameters.shared_memory_byte_size: 9223372036854775808 does not fit a "
          "signed 64-bit integer");
  refused({{"binary_data_size", uint64_t{1} << 63}},
          "binary_data_size: 9223372036854775808 does not fit");
}

// gRPC: inputs in shared memory have no raw_input_contents entry; the others keep theirs in order.
TEST(KServeConvertTest, GrpcSharedMemoryReferences) {
  inference::ModelInferRequest request;
  for (const char* name : {"Q", "K", "V"}) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t d : {1, 2, 1, 2}) input->add_shape(d);
    if (name[0] == 'K') {
      (*input->mutable_parameters())["shared_memory_region"].set_string_param("r");
      (*input->mutable_parameters())["shared_memory_byte_size"].set_int64_param(16);
    } else {
      request.add_raw_input_contents(std::string(16, name[0]));
    }
  }
  v1::AttentionRequest out;
  std::vector<OutputSpec> outputs;
  int64_t timeout_us = 0;
  ShmParams shm[3];
  ASSERT_TRUE(GrpcInferToAttention(&request, &out, &outputs, &timeout_us, shm).ok());
  EXPECT_EQ(out.q().data(), std::string(16, 'Q'));
  EXPECT_EQ(out.v().data(), std::string(16, 'V'));
  EXPECT_TRUE(out.k().data().empty());
  EXPECT_EQ(shm[1].region, "r");
  EXPECT_EQ(shm[1].byte_size, 16u);

  inference::ModelInferRequest three = request;  // an entry for the shm input too: refused
  three.add_raw_input_contents(std::string(16, 'x'));
  absl::Status s = GrpcInferToAttention(&three, &out, &outputs, &timeout_us, shm);
  EXPECT_THAT(s.message(), HasSubstr("3 entries for 2 inputs not in shared memory"));
  inference::ModelInferRequest no_shm = request;  // an edge that takes no shared memory
  s = GrpcInferToAttention(&no_shm, &out, &outputs, &timeout_us);
  EXPECT_THAT(s.message(), HasSubstr("inputs[1]: shared memory is not accepted here"));

  // uint64 parameters past int64, as REST's: an offset kept as sent (it was INT64_MAX, which the
  // region's range error then showed), a size refused and named as sent.
  inference::ModelInferRequest far = request;
  auto& far_params = *far.mutable_inputs(1)->mutable_parameters();
  far_params["shared_memory_offset"].set_uint64_param(std::numeric_limits<uint64_t>::max());
  ASSERT_TRUE(GrpcInferToAttention(&far, &out, &outputs, &timeout_us, shm).ok());
  EXPECT_EQ(shm[1].offset, std::numeric_limits<uint64_t>::max());
  far_params["shared_memory_byte_size"].set_uint64_param(uint64_t{1} << 63);
  s = GrpcInferToAttention(&far, &out, &outputs, &timeout_us, shm);
  EXPECT_THAT(s.message(), HasSubstr("inputs[1].parameters.shared_memory_byte_size: "
                                     "9223372036854775808 does not fit a signed 64-bit integer"));
}

TEST(KServeConvertTest, GrpcOutputsInSharedMemoryAreNotSentInline) {
  // The runtime leaves a copy of an output in the response when the region's address did not
  // suit the kernels (computed beside it, then copied there): it was sent as well.
  ModelInfo model;
  v1::AttentionResponse response;
  response.mutable_out()->set_dtype(v1::FLOAT16);
  response.mutable_out()->set_data(std::string(128, 'o'));
  response.mutable_lse()->set_dtype(v1::FLOAT32);
  response.mutable_lse()->set_data(std::string(32, 'l'));
  std::vector<OutputSpec> outputs(2);
  outputs[0].kind = OutputSpec::kOut;
  outputs[0].shm.region = "r";
  outputs[1].kind = OutputSpec::kLse;
  inference::ModelInferResponse answer;
  AttentionToGrpcInfer(model, "id", outputs, &response, &answer);
  ASSERT_EQ(answer.outputs_size(), 2);
  ASSERT_EQ(answer.raw_output_contents_size(), 2) << "one entry per output, as tritonclient reads";
  EXPECT_EQ(answer.outputs(0).name(), "O");
  EXPECT_EQ(answer.outputs(0).datatype(), "FP16");
  EXPECT_TRUE(answer.raw_output_contents(0).empty()) << "O is in its region";
  EXPECT_EQ(answer.raw_output_contents(1), std::string(32, 'l'));
}


absl::Status WireObjectsOf(const std::string& wire, const google::protobuf::Descriptor& type,
                           int64_t max_objects = kMaxWireObjects) {
  google::protobuf::io::ArrayInputStream input(wire.data(), int(wire.size()));
  return CheckWireObjects(&input, type, max_objects);
}

std::string Repeated(const std::string& field, int64_t times) {
  std::string out;
  for (int64_t i = 0; i < times; ++i) out += field;
  return out;
}

// Fields that each parse into an object of their own are counted before the parse: a 32 MiB
// ModelInfer of empty inputs held 3.6 GiB, a 32 MiB ServerLive of unknown fields 1 GiB.
TEST(KServeConvertTest, WireObjectsAreCountedBeforeTheParse) {
  const auto& infer = *inference::ModelInferRequest::descriptor();
  const auto& live = *inference::ServerLiveRequest::descriptor();
  const int64_t past = kMaxWireObjects + 1;
  struct Case {
    const char* what;
    std::string wire;
    const google::protobuf::Descriptor* type;
  };
  const std::string empty_input("\x2a\x00", 2);              // inputs {}
  const std::string unpacked_dim = "\x2a\x02\x18\x01";        // inputs { shape: 1 } unpacked
  std::string group_of_unknowns = "\x0b";                       // field 1, a group (unknown)
  group_of_unknowns += Repeated(std::string("\x10\x00", 2), past) + "\x0c";
  std::string one_input_many_dims = "\x2a";                     // one input, `past` dims unpacked
  const std::string dims = Repeated(std::string("\x18\x01", 2), past);
  // The length as a varint.
  for (uint64_t n = dims.size(); ; n >>= 7) {
    if (n < 0x80) { one_input_many_dims += char(n); break; }
    one_input_many_dims += char((n & 0x7f) | 0x80);
  }
  one_input_many_dims += dims;
  const Case refused[] = {
      {"empty inputs", Repeated(empty_input, past), &infer},
      {"empty raw_input_contents", Repeated(std::string("\x3a\x00", 2), past), &infer},
      {"unknown fields of ServerLive", Repeated(std::string("\x08\x00", 2), past), &live},
      {"fields of an unknown group", group_of_unknowns, &live},
      {"dims of one input, unpacked", one_input_many_dims, &infer},
      {"inputs of one dim each", Repeated(unpacked_dim, past / 2 + 1), &infer},
  };
  for (const Case& c : refused) {
    const absl::Status s = WireObjectsOf(c.wire, *c.type);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(s.message(), HasSubstr("more than 65536")) << c.what;
    EXPECT_TRUE(WireObjectsOf(c.wire, *c.type, 2 * past).ok()) << c.what << ": counted right";
  }

  // What clients send passes, whatever its bytes: tensors in raw_input_contents, packed shapes
  // and typed contents.
  inference::ModelInferRequest request;
  request.set_model_name("attention");
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  for (const char* name : {"Q", "K", "V"}) {
    auto* input = request.add_inputs();
    input->set_name(name);
    input->set_datatype("FP32");
    for (int64_t d : {1, 1024, 8, 64}) input->add_shape(d);
    request.add_raw_input_contents(std::string(1 << 20, 'x'));
  }
  for (int i = 0; i < 1 << 18; ++i) {
    request.mutable_inputs(0)->mutable_contents()->add_fp32_contents(1.f);
    request.mutable_inputs(0)->add_shape(1);
  }
  request.add_outputs()->set_name("O");
  EXPECT_TRUE(WireObjectsOf(request.SerializeAsString(), infer, 64).ok());

  // Nesting deeper than any KServe message is refused; bytes that do not parse are left to the
  // parse (which refuses them).
  const std::string deep = Repeated("\x0b", 40) + Repeated("\x0c", 40);
  EXPECT_THAT(WireObjectsOf(deep, live).message(), HasSubstr("nested more than 32"));
  EXPECT_TRUE(WireObjectsOf("\x2a\xff\xff", infer).ok());
  EXPECT_TRUE(WireObjectsOf("\x2a\x10\x0a", infer).ok());
}

}  // namespace
}  // namespace flashserve::kserve
