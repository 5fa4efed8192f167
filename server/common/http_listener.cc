#include "common/http_listener.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace flashserve {

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(
    const HttpListenerOptions& options, const std::function<void(httplib::Server&)>& configure) {
  auto listener = std::unique_ptr<HttpListener>(new HttpListener());
  const bool tls = !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (tls) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
    }
    auto ssl = std::make_unique<httplib::SSLServer>(options.tls_cert_file.c_str(),
                                                    options.tls_key_file.c_str());
    if (!ssl->is_valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.name, ": cannot load the TLS certificate ", options.tls_cert_file,
                       " / key ", options.tls_key_file));
    }
    listener->server_ = std::move(ssl);
  } else {
    listener->server_ = std::make_unique<httplib::Server>();
  }
  httplib::Server& server = *listener->server_;
  const int threads = options.threads > 0 ? options.threads : 1;
  server.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  server.set_payload_max_length(options.payload_max_length);
  // httplib's default adds SO_REUSEPORT, which would let a second process share the port and
  // take half the requests; SO_REUSEADDR alone keeps restarts quick and a taken port an error.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });
  if (options.auth != nullptr) {
    const BearerAuth* auth = options.auth;
    auto open_path = options.open_path;
    auto on_unauthenticated = options.on_unauthenticated;
    server.set_pre_routing_handler(
        [auth, open_path, on_unauthenticated](const httplib::Request& req, httplib::Response& res) {
          if ((open_path && open_path(req.path)) ||
              auth->Allows(req.get_header_value("Authorization"))) {
            return httplib::Server::HandlerResponse::Unhandled;
          }
          if (on_unauthenticated) on_unauthenticated();
          res.status = 401;
          res.set_header("WWW-Authenticate", "Bearer");
          res.set_content(R"({"error":"missing or invalid bearer token"})", "application/json");
          return httplib::Server::HandlerResponse::Handled;
        });
  }
  if (configure) configure(server);

  if (options.port == 0) {
    listener->port_ = server.bind_to_any_port(options.host);
    if (listener->port_ <= 0) {
      return absl::UnavailableError(
          absl::StrCat(options.name, ": cannot listen on ", options.host));
    }
  } else {
    if (!server.bind_to_port(options.host, options.port)) {
      return absl::UnavailableError(
          absl::StrCat(options.name, ": cannot listen on ", options.host, ":", options.port));
    }
    listener->port_ = options.port;
  }
  listener->thread_ = std::thread([&server] { server.listen_after_bind(); });
  // cpp-httplib 0.11 loses a stop() issued before the accept loop runs: wait until it does.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!server.is_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!server.is_running()) {
    listener->Stop();
    return absl::UnavailableError(absl::StrCat(options.name, ": listener on ", options.host, ":",
                                               listener->port_, " did not start"));
  }
  return listener;
}

HttpListener::~HttpListener() { Stop(); }

void HttpListener::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace flashserve
