#include "metrics/metrics_http.h"

#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/http_listener.h"

namespace flashserve {

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<HttpListener> listener)
    : listener_(std::move(listener)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    const MetricsHttpOptions& options, ServerMetrics* metrics) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics HTTP: no metrics to serve");
  HttpListenerOptions listener;
  listener.name = "metrics HTTP";
  listener.host = options.host;
  listener.port = options.port;
  listener.threads = options.threads;
  listener.max_connections = options.max_connections;
  listener.max_connections_per_ip = options.max_connections_per_ip;
  listener.max_header_bytes = options.max_header_bytes;
  listener.idle_timeout_s = options.idle_timeout_s;
  listener.header_timeout_s = options.header_timeout_s;
  listener.body_timeout_s = options.header_timeout_s;  // no route takes a body
  listener.tls_cert_file = options.tls_cert_file;
  listener.tls_key_file = options.tls_key_file;
  listener.auth = options.auth;
  listener.not_found.status = 404;
  listener.not_found.content_type = "text/plain; charset=utf-8";
  listener.not_found.body = "HTTP 404: only GET /metrics is served here\n";
  // Refused scrapes count like the HTTP edge's (method "HTTP"); scrapes themselves do not.
  listener.on_finished = [metrics](const HttpCallRecord& call) {
    metrics->RecordRequest(call.metric, static_cast<int>(call.status.code()), call.seconds,
                           call.bytes_in, call.bytes_out);
  };
  HttpRoute scrape;
  scrape.pattern = "/metrics";  // HEAD is answered by it too (no body)
  scrape.get = [metrics](const HttpRequest&) -> HttpAnswer {
    HttpResponse res;
    res.content_type = metrics::kContentType;
    res.body = metrics->Render();
    return res;
  };
  std::vector<HttpRoute> routes;
  routes.push_back(std::move(scrape));
  absl::StatusOr<std::unique_ptr<HttpListener>> started =
      HttpListener::Start(listener, std::move(routes));
  if (!started.ok()) return started.status();
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(*std::move(started)));
}

int MetricsHttpServer::port() const { return listener_->port(); }

void MetricsHttpServer::Stop() { listener_->Stop(); }

}  // namespace flashserve
