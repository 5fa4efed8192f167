// The gRPC edge's shared pieces without a server: the per-call wrapper (metrics, inflight, status),
// the method table against the .proto services, parsing a raw request, the token gate's rule,
// the memory quota's rule.
#include <unistd.h>

#include <set>
#include <string>

#include "common/protobuf_errors.h"
#include "edge/grpc/grpc_auth.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_memory_quota.h"
#include "flashserve/v1/attention.pb.h"
#include "flashserve/v1/sequences.pb.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"
#include "inference/open_inference_grpc.pb.h"

namespace flashserve {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

bool Has(const std::string& text, const std::string& line) {
  return text.find(line + "\n") != std::string::npos;
}

TEST(GrpcCallTest, RecordsEachCallOnceWithItsStatusAndBytes) {
  ServerMetrics metrics;
  {
    GrpcCall call(&metrics, grpc_methods::kCompute);
    call.Start(100);
    EXPECT_TRUE(Has(metrics.Render(), "flashserve_inflight_requests 1"));
    call.AddBytesOut(40);
    const grpc::Status status = call.Finish(absl::NotFoundError("unknown session"));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_EQ(status.error_message(), "unknown session");
    EXPECT_TRUE(call.finished());
  }
  {
    GrpcCall call(&metrics, grpc_methods::kUpload);  // not a computing method: not inflight
    call.Start();
    EXPECT_TRUE(Has(metrics.Render(), "flashserve_inflight_requests 0"));
    call.AddBytesIn(7);
    call.AddBytesOut(3);
    EXPECT_TRUE(call.Finish(absl::OkStatus()).ok());
  }
  {
    GrpcCall abandoned(&metrics, grpc_methods::kAttention);  // torn down unfinished
    abandoned.Start(1);
  }
  const std::string text = metrics.Render();
  EXPECT_TRUE(Has(text, R"(flashserve_requests_total{method="Compute",status="NOT_FOUND"} 1)"));
  EXPECT_TRUE(Has(text, R"(flashserve_requests_total{method="Upload",status="OK"} 1)"));
  EXPECT_TRUE(Has(text, R"(flashserve_request_duration_seconds_count{method="Upload"} 1)"));
  EXPECT_TRUE(Has(text, "flashserve_inflight_requests 0"));
  // In: 100 (the failed call's request) + 7; out: only the successful call's 3.
  EXPECT_TRUE(Has(text, R"(flashserve_request_bytes_total{direction="in"} 107)")) << text;
  EXPECT_TRUE(Has(text, R"(flashserve_request_bytes_total{direction="out"} 3)")) << text;
}

TEST(GrpcCallTest, RefusedCallsAreCountedUnderTheirMethod) {
  ServerMetrics metrics;
  RecordRefusedCall(&metrics, grpc_methods::kModelInfer.label,
                    absl::UnauthenticatedError(kUnauthenticatedMessage));
  RecordRefusedCall(nullptr, "Attention", absl::UnauthenticatedError("x"));  // no metrics: fine
  EXPECT_TRUE(Has(metrics.Render(),
                  R"(flashserve_requests_total{method="ModelInfer",status="UNAUTHENTICATED"} 1)"));
}

// Every method of the three services the edge serves is in the table (or is health), and every
// entry names a real method: a method added to a .proto cannot go unwrapped unnoticed.
TEST(GrpcMethodsTest, CoverEveryServedMethodOfTheProtos) {
  const google::protobuf::FileDescriptor* native = v1::AttentionRequest::descriptor()->file();
  const google::protobuf::FileDescriptor* kserve =
      inference::ModelInferRequest::descriptor()->file();
  const google::protobuf::FileDescriptor* sequences =
      v1::CreateSequenceRequest::descriptor()->file();
  const google::protobuf::ServiceDescriptor* services[] = {
      native->FindServiceByName("AttentionService"),
      native->FindServiceByName("AttentionStreamService"),
      kserve->FindServiceByName("GRPCInferenceService"),
      sequences->FindServiceByName("Sequences")};
  const std::set<std::string> health = {"/inference.GRPCInferenceService/ServerLive",
                                        "/inference.GRPCInferenceService/ServerReady"};
  std::set<std::string> served;
  for (const google::protobuf::ServiceDescriptor* service : services) {
    ASSERT_NE(service, nullptr);
    for (int i = 0; i < service->method_count(); ++i) {
      const std::string path = "/" + service->full_name() + "/" + service->method(i)->name();
      served.insert(path);
      if (health.count(path) == 0) {
        const GrpcMethod* method = FindGrpcMethod(path);
        ASSERT_NE(method, nullptr) << path << " is served but has no GrpcMethod";
        EXPECT_EQ(method->label, service->method(i)->name());
      }
    }
  }
  std::set<std::string> labels;
  for (const GrpcMethod& method : GrpcMethods()) {
    EXPECT_EQ(served.count(std::string(method.path)), 1u) << method.path;
    EXPECT_TRUE(labels.insert(std::string(method.label)).second) << method.label;
  }
  EXPECT_EQ(GrpcMethodLabels().size(), GrpcMethods().size() + 1);  // + "other"
  EXPECT_EQ(FindGrpcMethod("/grpc.health.v1.Health/Check"), nullptr);
}

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A raw method's request: parsed, or INVALID_ARGUMENT naming the message -- and the field, when a
// string is not UTF-8 (protobuf's complaint is taken into the status, not logged).
TEST(ParseRequestTest, NamesTheMessageAndTheFieldThatIsNotUtf8) {
  RouteProtobufLogs();
  v1::GetSequenceInfoRequest good;
  good.set_sequence_id("0123456789abcdef0123456789abcdef");
  v1::GetSequenceInfoRequest parsed;
  ASSERT_TRUE(ParseRequest(Bytes(good.SerializeAsString()), &parsed).ok());
  EXPECT_EQ(parsed.sequence_id(), good.sequence_id());

  const absl::Status not_utf8 = ParseRequest(Bytes("\x0a\x02\xff\xfe"), &parsed);
  EXPECT_EQ(not_utf8.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(not_utf8.message(),
            "flashserve.v1.GetSequenceInfoRequest: malformed protobuf bytes (String field "
            "'flashserve.v1.GetSequenceInfoRequest.sequence_id' contains invalid UTF-8 data)");
  // Garbage carries no reason; the reason of the failure before does not linger.
  const absl::Status garbage = ParseRequest(Bytes("\xff\xff\xff"), &parsed);
  EXPECT_EQ(garbage.message(), "flashserve.v1.GetSequenceInfoRequest: malformed protobuf bytes");
  // Truncated inside a string.
  const std::string whole = good.SerializeAsString();
  EXPECT_EQ(ParseMessage(std::string_view(whole).substr(0, 10), &parsed).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ParseRequestTest, AnAnswerSerializesToWhatItSays) {
  v1::SequenceInfo info;
  info.set_sequence_id("abc");
  info.add_layer_lengths(7);
  grpc::ByteBuffer raw;
  ASSERT_TRUE(SerializeAnswer(info, &raw).ok());
  v1::SequenceInfo back;
  ASSERT_TRUE(ParseRequest(raw, &back).ok());
  EXPECT_EQ(back.sequence_id(), "abc");
  ASSERT_EQ(back.layer_lengths_size(), 1);
  EXPECT_EQ(back.layer_lengths(0), 7);
}

TEST(GrpcTokenGateTest, EveryCallButHealthNeedsTheToken) {
  const std::string token = "token-0123456789abcdef";
  absl::StatusOr<std::unique_ptr<BearerAuth>> auth = BearerAuth::FromToken(token);
  ASSERT_TRUE(auth.ok());
  const std::string bearer = "Bearer " + token;
  for (const GrpcMethod& method : GrpcMethods()) {
    EXPECT_TRUE(CheckGrpcCallToken(nullptr, method.path, "").ok()) << "no token configured";
    EXPECT_EQ(CheckGrpcCallToken(auth->get(), method.path, "").code(),
              absl::StatusCode::kUnauthenticated)
        << method.path;
    EXPECT_EQ(CheckGrpcCallToken(auth->get(), method.path, "Bearer wrong").code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_TRUE(CheckGrpcCallToken(auth->get(), method.path, bearer).ok()) << method.path;
  }
  for (const char* path :
       {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "/made.up/Path", "",
        "/grpc.health.v1.Health/CheckX", "/grpc.health.v1.Health"}) {
    EXPECT_EQ(CheckGrpcCallToken(auth->get(), path, "").code(), absl::StatusCode::kUnauthenticated)
        << path;  // fail closed: only the exact health paths are open
  }
  for (const char* path : {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                           "/inference.GRPCInferenceService/ServerLive",
                           "/inference.GRPCInferenceService/ServerReady"}) {
    EXPECT_TRUE(CheckGrpcCallToken(auth->get(), path, "").ok()) << path;
  }
}

TEST(GrpcMemoryQuotaTest, AutoIsAQuarterOfTheHostCappedAndFloored) {
  // A quarter of the host...
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, kGiB, 8 * kGiB), 2 * kGiB);
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, 64 * kMiB, 2 * kGiB), 512 * kMiB);
  // ... at most 4 GiB ...
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, kGiB, 256 * kGiB), 4 * kGiB);
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, kGiB, 0), 4 * kGiB);  // host memory unknown
  // ... and never below one largest request plus a stream's lookahead.
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, kGiB, 2 * kGiB), kGiB + 64 * kMiB);
  EXPECT_EQ(*ResolveGrpcMemoryQuota(-1, 2 * kGiB - 1, 0), 4 * kGiB);
  // Explicit values are kept; 0 is gRPC's default (none); below -1 is an error.
  EXPECT_EQ(*ResolveGrpcMemoryQuota(0, kGiB, 8 * kGiB), 0);
  EXPECT_EQ(*ResolveGrpcMemoryQuota(123456789, kGiB, 8 * kGiB), 123456789);
  EXPECT_EQ(ResolveGrpcMemoryQuota(-2, kGiB, 8 * kGiB).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GrpcMemoryQuotaTest, HostMemoryIsKnownAndAtMostPhysical) {
  const int64_t physical = int64_t{sysconf(_SC_PHYS_PAGES)} * sysconf(_SC_PAGESIZE);
  const int64_t host = HostMemoryBytes();
  EXPECT_GT(host, 0);
  EXPECT_LE(host, physical);
}

}  // namespace
}  // namespace flashserve
