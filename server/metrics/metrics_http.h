// The metrics endpoint: GET /metrics on its own port (common/http_listener.h, the same hardened
// listener and middleware as the HTTP edge), 404 for every other path.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/auth.h"
#include "metrics/server_metrics.h"

namespace flashserve {

struct MetricsHttpOptions {
  std::string host = "127.0.0.1";
  int port = 8002;  // 0: pick a free port
  int threads = 2;  // epoll threads; scrapes are rare and cheap
  std::string tls_cert_file, tls_key_file;  // both set: HTTPS
  const BearerAuth* auth = nullptr;         // set: scrapes need "Authorization: Bearer <token>"
  int max_connections = 2048;       // as the HTTP edge's (--http_max_connections)
  int max_connections_per_ip = 0;
  int max_header_bytes = 16 << 10;
  int idle_timeout_s = 30;
  int header_timeout_s = 10;
};

class HttpListener;

/// Thread-safe. Serves on its own threads from Create until Stop or destruction. `metrics` must
/// outlive the server (Stop first, then destroy the metrics).
class MetricsHttpServer {
 public:
  /// Returns once the listener runs. UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Create(
      const MetricsHttpOptions& options, ServerMetrics* metrics);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const;
  /// Stops listening and joins the server thread; idempotent.
  void Stop();

 private:
  explicit MetricsHttpServer(std::unique_ptr<HttpListener> listener);
  std::unique_ptr<HttpListener> listener_;
};

}  // namespace flashserve
