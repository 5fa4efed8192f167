// The HTTP edge (cpp-httplib): /v2/health/live and /v2/health/ready.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: pick a free port
  int threads = 4;  // connection handler threads
};

/// Thread-safe. Serves on its own threads from Create until Stop or destruction.
class HttpEdge {
 public:
  static absl::StatusOr<std::unique_ptr<HttpEdge>> Create(const HttpOptions& options,
                                                          AttentionRuntime* runtime);
  ~HttpEdge();
  int port() const;
  void Stop();

 private:
  struct Impl;
  explicit HttpEdge(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace flashserve
