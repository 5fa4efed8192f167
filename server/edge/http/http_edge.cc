#include "edge/http/http_edge.h"

#include <utility>
#include <vector>

#include "common/http_listener.h"
#include "edge/http/kserve_rest.h"
#include "edge/http/shm_rest.h"

namespace flashserve {

HttpEdge::HttpEdge(std::unique_ptr<HttpListener> listener) : listener_(std::move(listener)) {}

HttpEdge::~HttpEdge() { Stop(); }

namespace {

std::vector<HttpRoute> HealthRoutes(AttentionRuntime* runtime, bool open) {
  HttpRoute live;
  live.pattern = "/v2/health/live";
  live.open = open;
  // Not live after a sticky device fault: a liveness probe then restarts the process.
  live.get = [runtime](const HttpRequest&) -> HttpAnswer {
    const bool ok = runtime->live();
    return HttpResponse::Json(ok ? 200 : 503, ok ? R"({"live":true})" : R"({"live":false})");
  };
  HttpRoute ready;
  ready.pattern = "/v2/health/ready";
  ready.open = open;
  ready.get = [runtime](const HttpRequest&) -> HttpAnswer {
    const bool ok = runtime->ready();
    return HttpResponse::Json(ok ? 200 : 503, ok ? R"({"ready":true})" : R"({"ready":false})");
  };
  return {std::move(live), std::move(ready)};
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpEdge>> HttpEdge::Create(const HttpOptions& options,
                                                           AttentionRuntime* runtime,
                                                           const kserve::KServeOptions& kserve) {
  if (options.max_json_bytes < 1024 || options.max_receive_bytes < 1) {
    return absl::InvalidArgumentError(
        "--http_max_json_bytes must be >= 1024 and --http_max_receive_bytes >= 1");
  }
  HttpListenerOptions listener;
  listener.name = "HTTP";
  listener.host = options.host;
  listener.port = options.port;
  listener.threads = options.threads;
  listener.max_connections = options.max_connections;
  listener.max_connections_per_ip = options.max_connections_per_ip;
  listener.max_header_bytes = options.max_header_bytes;
  listener.idle_timeout_s = options.idle_timeout_s;
  listener.header_timeout_s = options.header_timeout_s;
  listener.body_timeout_s = options.body_timeout_s;
  listener.answer_timeout_s = options.answer_timeout_s;
  listener.min_body_bytes_per_s = options.min_body_bytes_per_s;
  listener.tls_cert_file = options.tls_cert_file;
  listener.tls_key_file = options.tls_key_file;
  listener.auth = options.auth;
  if (ServerMetrics* metrics = runtime->metrics()) {
    listener.on_finished = [metrics](const HttpCallRecord& call) {
      metrics->RecordRequest(call.metric, static_cast<int>(call.status.code()), call.seconds,
                             call.bytes_in, call.bytes_out);
    };
  }
  std::vector<HttpRoute> routes = HealthRoutes(runtime, options.open_health);
  KServeRestLimits limits;
  limits.max_request_bytes = options.max_request_bytes;
  limits.max_json_bytes = options.max_json_bytes;
  limits.budget = std::make_shared<ReceiveBudget>(options.max_receive_bytes);
  kserve::KServeOptions rest = kserve;
  rest.max_request_bytes = options.max_request_bytes;
  for (HttpRoute& route : ShmRestRoutes(runtime)) routes.push_back(std::move(route));
  for (HttpRoute& route : KServeRestRoutes(runtime, rest, limits)) {
    routes.push_back(std::move(route));
  }
  absl::StatusOr<std::unique_ptr<HttpListener>> started =
      HttpListener::Start(listener, std::move(routes));
  if (!started.ok()) return started.status();
  return std::unique_ptr<HttpEdge>(new HttpEdge(*std::move(started)));
}

int HttpEdge::port() const { return listener_->port(); }

void HttpEdge::Stop(absl::Duration finish_answers) { listener_->Stop(finish_answers); }

}  // namespace flashserve
