// The HTTP edge (cpp-httplib): /v2/health/live and /v2/health/ready.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/attention_runtime.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace flashserve {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: pick a free port
  int threads = 4;  // connection handler threads
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
  struct Impl;
  explicit HttpEdge(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashserve
