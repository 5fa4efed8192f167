// Who may call the gRPC port: TLS (optional) and the bearer-token gate (optional), both in the
// listening port's credentials.
//
// The gate is a gRPC auth metadata processor: gRPC core runs it on a call's headers (metadata
// "authorization: Bearer <token>") as soon as they arrive, before the call reaches any handler
// and before its message is read, on every service of the port alike -- native, KServe v2,
// striped streams, reflection, and paths nobody serves. A refused call is failed inside gRPC
// with UNAUTHENTICATED; no handler runs, no message is assembled, nothing reaches the runtime.
// It is counted in flashserve_requests_total{method,status="UNAUTHENTICATED"} (edge/grpc/
// grpc_call.h). Health stays open: grpc.health.v1.Health and KServe's ServerLive / ServerReady.
//
// What gRPC 1.51 still reads of a refused call: the bytes the client sent before the refusal
// reached it, at most what HTTP/2 flow control let it send: the stream's window (64 KiB
// initially; gRPC's BDP probing grows windows on busy connections, and grpc_edge.cc lets a
// stream's lookahead reach 64 MiB, GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES). Those bytes pass through
// the transport's read buffers and are dropped; none of them is assembled into a message.
// tests/python/test_grpc_auth_gate.py sends 256 MiB without a token, twice, to ModelInfer,
// OpenSession and Attention and checks the server's peak RSS: it grew by 1-6 MiB here (by 680-740
// MiB for ModelInfer and OpenSession before the gate, when the handlers checked).
//
// gRPC's C++ API refuses a metadata processor on insecure credentials (it asserts), although
// gRPC core runs one on plaintext connections as well; so the port's credentials are made with
// gRPC core's C API here, the same for TLS and plaintext.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/auth.h"
#include "grpcpp/security/server_credentials.h"
#include "metrics/server_metrics.h"

namespace flashserve {

inline constexpr const char kUnauthenticatedMessage[] = "missing or invalid bearer token";

struct GrpcCredentialsOptions {
  std::string tls_cert_file, tls_key_file;  // both set: TLS; neither: plaintext
  const BearerAuth* auth = nullptr;         // set: every call but health needs the token
  ServerMetrics* metrics = nullptr;         // counts refused calls; may be null
};

/// The listening port's credentials. `auth` and `metrics` must outlive the server.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeGrpcServerCredentials(
    const GrpcCredentialsOptions& options);

/// The gate's decision for a call to `path` with `authorization` (empty when absent): OK, or
/// UNAUTHENTICATED. Exposed for tests; the gate also records and logs a refusal.
absl::Status CheckGrpcCallToken(const BearerAuth* auth, std::string_view path,
                                std::string_view authorization);

}  // namespace flashserve
