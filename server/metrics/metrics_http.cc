#include "metrics/metrics_http.h"

#include <chrono>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace flashserve {

struct MetricsHttpServer::Impl {
  httplib::Server server;
  std::thread thread;
  int port = 0;
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Create(
    const MetricsHttpOptions& options, const ServerMetrics* metrics) {
  if (metrics == nullptr) return absl::InvalidArgumentError("metrics HTTP: no metrics to serve");
  auto impl = std::make_unique<Impl>();
  httplib::Server& server = impl->server;
  const int threads = options.threads > 0 ? options.threads : 1;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  server.set_payload_max_length(1 << 16);  // GET only: no body worth reading
  // httplib's default also sets SO_REUSEPORT, which lets a second process bind the same port and
  // take half the scrapes; SO_REUSEADDR alone keeps restarts quick and a taken port an error.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });

  // httplib answers HEAD with the GET handler (body dropped).
  server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(), metrics::kContentType);
  });
  server.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.body.empty()) {
      res.set_content(absl::StrCat("HTTP ", res.status, ": only GET /metrics is served here\n"),
                      "text/plain; charset=utf-8");
    }
  });

  if (options.port == 0) {
    impl->port = server.bind_to_any_port(options.host);
    if (impl->port <= 0) {
      return absl::UnavailableError(absl::StrCat("metrics HTTP: cannot listen on ", options.host));
    }
  } else {
    if (!server.bind_to_port(options.host, options.port)) {
      return absl::UnavailableError(
          absl::StrCat("metrics HTTP: cannot listen on ", options.host, ":", options.port));
    }
    impl->port = options.port;
  }
  impl->thread = std::thread([&server] { server.listen_after_bind(); });
  // cpp-httplib 0.11 loses a stop() issued before the accept loop runs: wait until it does.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!server.is_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server.is_running()) {
    server.stop();
    impl->thread.join();  // listen_after_bind returned (or never accepted): nothing to wait for
    return absl::UnavailableError(absl::StrCat("metrics HTTP: listener on ", options.host, ":",
                                               impl->port, " did not start"));
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl)));
}

int MetricsHttpServer::port() const { return impl_->port; }

void MetricsHttpServer::Stop() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace flashserve
