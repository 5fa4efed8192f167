#include "edge/http_edge.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace flashserve {

struct HttpEdge::Impl {
  httplib::Server server;
  std::thread thread;
  int port = 0;
};

HttpEdge::HttpEdge(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpEdge::~HttpEdge() { Stop(); }

absl::StatusOr<std::unique_ptr<HttpEdge>> HttpEdge::Create(
    const HttpOptions& options, AttentionRuntime* runtime,
    const std::function<void(httplib::Server&)>& register_routes) {
  auto impl = std::make_unique<Impl>();
  httplib::Server& server = impl->server;
  const int threads = options.threads;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  server.set_payload_max_length(1 << 20);  // health only: nothing big to read yet
  // httplib's default adds SO_REUSEPORT, which would let a second process share the port.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });

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
      res.set_content(absl::StrCat(R"({"error":"HTTP )", res.status, R"("})"), "application/json");
    }
  });

  if (options.port == 0) {
    impl->port = server.bind_to_any_port(options.host);
    if (impl->port <= 0) {
      return absl::UnavailableError(absl::StrCat("HTTP: cannot listen on ", options.host));
    }
  } else {
    if (!server.bind_to_port(options.host, options.port)) {
      return absl::UnavailableError(
          absl::StrCat("HTTP: cannot listen on ", options.host, ":", options.port));
    }
    impl->port = options.port;
  }
  impl->thread = std::thread([&server] { server.listen_after_bind(); });
  // Stop() before the listener runs would be lost; wait until it is up.
  for (int i = 0; i < 2000 && !server.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return std::unique_ptr<HttpEdge>(new HttpEdge(std::move(impl)));
}

int HttpEdge::port() const { return impl_->port; }

void HttpEdge::Stop() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

}  // namespace flashserve
