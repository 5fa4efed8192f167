#include "metrics/metrics_http.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/http_listener.h"
#include "httplib.h"

namespace flashserve {

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<HttpListener> listener)
    : listener_(std::move(listener)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    const MetricsHttpOptions& options, const ServerMetrics* metrics) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics HTTP: no metrics to serve");
  HttpListenerOptions listener_options;
  listener_options.name = "metrics HTTP";
  listener_options.host = options.host;
  listener_options.port = options.port;
  listener_options.threads = options.threads;
  listener_options.payload_max_length = size_t{1} << 16;  // GET only: no body worth reading
  listener_options.tls_cert_file = options.tls_cert_file;
  listener_options.tls_key_file = options.tls_key_file;
  listener_options.auth = options.auth;
  absl::StatusOr<std::unique_ptr<HttpListener>> listener =
      HttpListener::Start(listener_options, [metrics](httplib::Server& server) {
        // httplib answers HEAD with the GET handler (body dropped).
        server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
          res.set_content(metrics->Render(), metrics::kContentType);
        });
        server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
          if (res.body.empty()) {
            res.set_content(
                absl::StrCat("HTTP ", res.status, ": only GET /metrics is served here\n"),
                "text/plain; charset=utf-8");
          }
        });
      });
  if (!listener.ok()) return listener.status();
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(*listener)));
}

int MetricsHttpServer::port() const { return listener_->port(); }

void MetricsHttpServer::Stop() { listener_->Stop(); }

}  // namespace flashserve
