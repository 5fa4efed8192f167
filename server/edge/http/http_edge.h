// The HTTP edge (port 8000, libmicrohttpd through common/http_listener.h): /v2/health/live,
// /v2/health/ready and the KServe v2 REST API (edge/http/kserve_rest.h), all through the
// listener's one middleware (auth, request metrics, failure log, status conversion).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "edge/kserve/kserve_model.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

class HttpListener;

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                               // 0: pick a free port
  int threads = 4;                               // epoll threads (connections spread over them)
  int64_t max_request_bytes = int64_t{1} << 30;  // request bodies above this get 413
  std::string tls_cert_file, tls_key_file;       // both set: HTTPS
  const BearerAuth* auth = nullptr;              // set: requests need "Authorization: Bearer"
  bool open_health = true;                       // /v2/health/* without a token
  // Hostile networks (server/edge/http/README.md):
  int max_connections = 2048;             // per HTTP port; more wait in the listen backlog
  int max_connections_per_ip = 0;         // 0: no per-address cap (load balancers share one)
  int max_header_bytes = 16 << 10;        // request line + headers (431 / 414 beyond)
  int idle_timeout_s = 30;                // connection silent this long: closed
  int header_timeout_s = 10;              // request line to end of headers: closed beyond
  int body_timeout_s = 300;               // end of headers to end of body: 408 beyond
  int answer_timeout_s = 120;             // an answer not taken this long: connection closed
  int64_t min_body_bytes_per_s = int64_t{1} << 20;  // slower on average after 5 s: cut off
  int64_t max_json_bytes = int64_t{64} << 20;     // JSON part of an infer body (413 beyond)
  int64_t max_receive_bytes = int64_t{4} << 30;  // body bytes held at once, all requests (503)
};

/// Thread-safe. Serves on its own threads from Create until Stop or destruction.
class HttpEdge {
 public:
  static absl::StatusOr<std::unique_ptr<HttpEdge>> Create(const HttpOptions& options,
                                                          AttentionRuntime* runtime,
                                                          const kserve::KServeOptions& kserve);
  ~HttpEdge();
  int port() const;
  /// Stops listening; answers being written may finish for `finish_answers`, requests still
  /// computing are answered 503 (common/http_listener.h).
  void Stop(absl::Duration finish_answers = absl::Seconds(10));

 private:
  explicit HttpEdge(std::unique_ptr<HttpListener> listener);
  std::unique_ptr<HttpListener> listener_;
};

}  // namespace flashserve
