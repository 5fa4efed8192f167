#include "edge/http/http_edge.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/http_listener.h"
#include "httplib.h"

namespace flashserve {

HttpEdge::HttpEdge(std::unique_ptr<HttpListener> listener) : listener_(std::move(listener)) {}

HttpEdge::~HttpEdge() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpEdge>> HttpEdge::Create(
    const HttpOptions& options, AttentionRuntime* runtime,
    const std::function<void(httplib::Server&)>& register_routes) {
  HttpListenerOptions listener_options;
  listener_options.name = "HTTP";
  listener_options.host = options.host;
  listener_options.port = options.port;
  listener_options.threads = options.threads;
  listener_options.payload_max_length = size_t(options.max_request_bytes);
  listener_options.tls_cert_file = options.tls_cert_file;
  listener_options.tls_key_file = options.tls_key_file;
  listener_options.auth = options.auth;
  if (options.open_health) {
    listener_options.open_path = [](const std::string& path) {
      return absl::StartsWith(path, "/v2/health/");
    };
  }
  if (ServerMetrics* metrics = runtime->metrics()) {
    listener_options.on_unauthenticated = [metrics] {
      metrics->RecordRequest("HTTP", 16 /* UNAUTHENTICATED */, 0.0, 0, 0);
    };
  }
  absl::StatusOr<std::unique_ptr<HttpListener>> listener =
      HttpListener::Start(listener_options, [&](httplib::Server& server) {
        server.Get("/v2/health/live", [](const httplib::Request&, httplib::Response& res) {
          res.set_content(R"({"live":true})", "application/json");
        });
        server.Get("/v2/health/ready", [runtime](const httplib::Request&, httplib::Response& res) {
          const bool ready = runtime->ready();
          res.status = ready ? 200 : 503;
          res.set_content(ready ? R"({"ready":true})" : R"({"ready":false})", "application/json");
        });
        if (register_routes) register_routes(server);
        server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
          if (res.body.empty()) {
            const char* what = res.status == 413   ? "request body exceeds --max_request_bytes"
                               : res.status == 404 ? "not found"
                                                   : "HTTP error";
            res.set_content(absl::StrCat(R"({"error":")", what, R"("})"), "application/json");
          }
        });
      });
  if (!listener.ok()) return listener.status();
  return std::unique_ptr<HttpEdge>(new HttpEdge(std::move(*listener)));
}

int HttpEdge::port() const { return listener_->port(); }

void HttpEdge::Stop() { listener_->Stop(); }

}  // namespace flashserve
