// One cpp-httplib server on its own threads: plain or TLS, optional bearer-token check, bound
// before Start returns. Shared by the HTTP edge (port 8000) and the metrics endpoint (8002).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/auth.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace flashserve {

struct HttpListenerOptions {
  std::string name = "HTTP";  // for messages
  std::string host = "127.0.0.1";
  int port = 0;  // 0: pick a free port
  int threads = 4;
  size_t payload_max_length = size_t{1} << 20;
  std::string tls_cert_file;  // both set: HTTPS
  std::string tls_key_file;
  const BearerAuth* auth = nullptr;  // set: every path but the open ones needs the token
  std::function<bool(const std::string& path)> open_path;  // may be empty (nothing open)
  std::function<void()> on_unauthenticated;                // counts rejections; may be empty
};

/// Thread-safe. Serves from Start until Stop or destruction.
class HttpListener {
 public:
  /// `configure` registers the routes before the listener starts.
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(
      const HttpListenerOptions& options, const std::function<void(httplib::Server&)>& configure);
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  int port() const { return port_; }
  /// Stops listening and joins the server thread; idempotent.
  void Stop();

 private:
  HttpListener() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace flashserve
