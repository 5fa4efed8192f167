#include "edge/grpc/grpc_auth.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/flag_file.h"
#include "edge/grpc/grpc_call.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// Calls that need no token: probes must work without it, and they reveal only SERVING or not.
constexpr std::string_view kOpenPaths[] = {
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
};

std::string_view View(const grpc_slice& slice) {
  return std::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                          GRPC_SLICE_LENGTH(slice));
}

// The processor's state: immutable, read by every gRPC thread that receives headers.
struct TokenGate {
  const BearerAuth* auth;
  ServerMetrics* metrics;
};

// grpc_auth_metadata_processor::process: runs inline on the gRPC thread that received the
// headers (it neither blocks nor allocates much), and answers through `done` before returning.
void ProcessCallMetadata(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                         size_t num_md, grpc_process_auth_metadata_done_cb done, void* user_data) {
  const auto* gate = static_cast<const TokenGate*>(state);
  std::string_view path, authorization;
  for (size_t i = 0; i < num_md; ++i) {
    const std::string_view key = View(md[i].key);
    if (key == ":path") path = View(md[i].value);
    if (key == "authorization") authorization = View(md[i].value);
  }
  const absl::Status status = CheckGrpcCallToken(gate->auth, path, authorization);
  if (status.ok()) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
    return;
  }
  const GrpcMethod* method = FindGrpcMethod(path);
  RecordRefusedCall(gate->metrics, method != nullptr ? method->label : grpc_methods::kOtherLabel,
                    status);
  done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, kUnauthenticatedMessage);
}

void DestroyTokenGate(void* state) { delete static_cast<TokenGate*>(state); }

// Credentials made with gRPC core's C API, handed to the C++ ServerBuilder.
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  // Constructed before the core credentials: the base class initializes gRPC.
  CoreServerCredentials() = default;
  ~CoreServerCredentials() override {
    if (credentials_ != nullptr) grpc_server_credentials_release(credentials_);
  }
  void Adopt(grpc_server_credentials* credentials) { credentials_ = credentials; }

  // The gate is installed at creation (MakeGrpcServerCredentials); nothing else may add one.
  void SetAuthMetadataProcessor(
      const std::shared_ptr<grpc::AuthMetadataProcessor>& /*processor*/) override {
    spdlog::error("SetAuthMetadataProcessor ignored: the gRPC edge installs its own token gate");
  }

 private:
  int AddPortToServer(const std::string& address, grpc_server* server) override {
    return grpc_server_add_http2_port(server, address.c_str(), credentials_);
  }

  grpc_server_credentials* credentials_ = nullptr;
};

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* what) {
  return ReadFlagFile(path, what, kMaxPemFileBytes);
}

absl::StatusOr<grpc_server_credentials*> MakeCoreCredentials(
    const GrpcCredentialsOptions& options) {
  if (options.tls_cert_file.empty() && options.tls_key_file.empty()) {
    return grpc_insecure_server_credentials_create();
  }
  if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  absl::StatusOr<std::string> cert = ReadFile(options.tls_cert_file, "--tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadFile(options.tls_key_file, "--tls_key");
  if (!key.ok()) return key.status();
  // As grpc::SslServerCredentials with one key/certificate pair and no client certificates.
  grpc_ssl_pem_key_cert_pair pair = {key->c_str(), cert->c_str()};
  grpc_server_credentials* credentials = grpc_ssl_server_credentials_create_ex(
      nullptr, &pair, 1, GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE, nullptr);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError("--tls_cert / --tls_key: gRPC cannot use them");
  }
  return credentials;
}

}  // namespace

absl::Status CheckGrpcCallToken(const BearerAuth* auth, std::string_view path,
                                std::string_view authorization) {
  if (auth == nullptr) return absl::OkStatus();
  for (std::string_view open : kOpenPaths) {
    if (path == open) return absl::OkStatus();
  }
  if (auth->Allows(absl::string_view(authorization.data(), authorization.size()))) {
    return absl::OkStatus();
  }
  return absl::UnauthenticatedError(kUnauthenticatedMessage);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeGrpcServerCredentials(
    const GrpcCredentialsOptions& options) {
  auto result = std::make_shared<CoreServerCredentials>();
  absl::StatusOr<grpc_server_credentials*> credentials = MakeCoreCredentials(options);
  if (!credentials.ok()) return credentials.status();
  result->Adopt(*credentials);
  if (options.auth != nullptr) {
    grpc_auth_metadata_processor processor;
    processor.process = ProcessCallMetadata;
    processor.destroy = DestroyTokenGate;
    processor.state = new TokenGate{options.auth, options.metrics};
    grpc_server_credentials_set_auth_metadata_processor(*credentials, processor);
  }
  return result;
}

}  // namespace flashserve
