// The HTTP edge (cpp-httplib, port 8000): /v2/health/live, /v2/health/ready, plus routes other
// modules register (the KServe v2 REST API).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/auth.h"
#include "runtime/attention_runtime.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace flashserve {

class HttpListener;

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                               // 0: pick a free port
  int threads = 4;                               // connection handler threads
  int64_t max_request_bytes = int64_t{1} << 30;  // request bodies above this get 413
  std::string tls_cert_file, tls_key_file;       // both set: HTTPS
  const BearerAuth* auth = nullptr;              // set: requests need "Authorization: Bearer"
  bool open_health = true;                       // /v2/health/* without a token
};

/// Thread-safe. Serves on its own threads from Create until Stop or destruction.
class HttpEdge {
 public:
  /// register_routes adds further endpoints (e.g. the KServe v2 REST API) before listening.
  static absl::StatusOr<std::unique_ptr<HttpEdge>> Create(
      const HttpOptions& options, AttentionRuntime* runtime,
      const std::function<void(httplib::Server&)>& register_routes = {});
  ~HttpEdge();
  int port() const;
  void Stop();

 private:
  explicit HttpEdge(std::unique_ptr<HttpListener> listener);
  std::unique_ptr<HttpListener> listener_;
};

}  // namespace flashserve
