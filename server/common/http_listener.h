// One HTTP/1.1 server for hostile networks, on GNU libmicrohttpd: epoll threads (no thread per
// connection), a connection cap, bounded header memory and count, idle / header / body timeouts,
// request bodies handed over piece by piece as they arrive, and a request whose answer is
// computed elsewhere waits suspended (it holds no thread). Plain or TLS (GnuTLS), bound before
// Start returns. Shared by the HTTP edge (port 8000) and the metrics endpoint (8002).
//
// Every request goes through one middleware (HttpListener::Impl::{Begin,Body,Finish,Respond},
// http_listener.cc): header limits, route match, the bearer token (checked as soon as the headers
// are in, before any body byte is read), the body size limit, status conversion (absl::Status ->
// HTTP code + {"error": ...}), the log line of a failure, and the per-request record handed to
// `on_finished` (request metrics). The daemon around it: http_listener_daemon.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/auth.h"
#include "common/http_status.h"

struct MHD_Connection;
struct MHD_Daemon;

namespace flashserve {

/// `{"error":"<message>"}`, always valid JSON: control bytes escaped, well-formed UTF-8 kept, any
/// other byte >= 0x80 replaced by U+FFFD.
std::string HttpErrorJson(absl::string_view message);

/// A request as its handler sees it. Valid only during the handler call.
class HttpRequest {
 public:
  HttpRequest(MHD_Connection* connection, absl::string_view method, absl::string_view path,
              std::vector<std::string> matches);
  absl::string_view method() const { return method_; }
  absl::string_view path() const { return path_; }
  /// The header's value ("" when absent); names are case-insensitive. Values are not decoded.
  absl::string_view header(absl::string_view name) const;
  bool has_header(absl::string_view name) const;
  /// Every value the request gives the header, in order (header() sees only the first): for framing
  /// headers whose repetition would let a proxy in front and the server split a body differently.
  std::vector<std::string> header_values(absl::string_view name) const;
  /// The route pattern's groups; [0] is the whole path, a group that did not take part is "".
  const std::vector<std::string>& matches() const { return matches_; }
  std::string match(size_t i) const { return i < matches_.size() ? matches_[i] : std::string(); }

 private:
  MHD_Connection* connection_;
  std::string method_, path_;
  std::vector<std::string> matches_;
};

/// What a handler answers with when it succeeds (its status may still be e.g. 503 for "not ready").
struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
  /// Sent after `body` without a copy; `keep` owns what they point into until they are sent.
  std::vector<absl::string_view> tail;
  std::shared_ptr<const void> keep;

  static HttpResponse Json(int status, std::string body);
  int64_t size() const;
};
/// A handler's answer: a response, or an error the middleware turns into {"error": ...}.
using HttpAnswer = absl::StatusOr<HttpResponse>;
/// Hands the answer back from any thread, exactly once.
using HttpReply = std::function<void(HttpAnswer)>;
/// Whether the client of a request waiting for its answer has left: its connection closed or
/// reset (a client that only stopped sending counts too: TCP cannot tell the two apart). For the
/// runtime's `cancelled`, as gRPC's IsCancelled; true for good once the request is over. Cheap (a
/// poll(), sometimes a recv(MSG_PEEK)) and callable from any thread, for as long as it is kept.
using HttpPeerGone = std::function<bool()>;

/// The receiver of one request body (POST routes). Called on the listener's threads, one call
/// at a time per request: keep OnBody short (copy, count, validate), never wait in it.
class HttpUpload {
 public:
  virtual ~HttpUpload() = default;
  /// The next piece of the body as it arrives. An error stops the upload: the rest of the body
  /// is read and dropped (the connection stays usable) and the error is the answer.
  virtual absl::Status OnBody(absl::string_view piece) = 0;
  /// The whole body is in (OnBody never failed). Start the work and answer through `reply`,
  /// from any thread, when done; the connection waits suspended meanwhile, holding no thread
  /// (nor watched: `peer_gone` says when the client has left and the work may stop).
  virtual void OnComplete(HttpReply reply, HttpPeerGone peer_gone) = 0;
  /// For the log line of a failure (e.g. the request's id); may be empty.
  virtual std::string LogContext() const { return {}; }
};

/// How long a body may arrive at any rate before HttpListenerOptions::min_body_bytes_per_s holds.
inline constexpr absl::Duration kMinBodyRateGrace = absl::Seconds(5);

/// Longer paths (without the query) get 414 before any route is matched.
inline constexpr size_t kMaxPathBytes = 2048;

struct HttpRoute {
  std::string method = "GET";  // "GET" (answers HEAD too) or "POST"
  std::string pattern;         // ECMAScript regex matched against the whole path
  std::string metric;          // `method` label of the request metrics; empty: not recorded
  bool open = false;           // served without the bearer token
  int64_t max_body_bytes = 0;  // POST: larger bodies get 413 naming `body_limit_flag`
  std::string body_limit_flag = "--max_request_bytes";
  std::function<HttpAnswer(const HttpRequest&)> get;  // GET: runs on a listener thread, be quick
  std::function<absl::StatusOr<std::unique_ptr<HttpUpload>>(const HttpRequest&)> post;
};

/// One finished request, for request metrics.
struct HttpCallRecord {
  std::string metric;  // the route's label ("HTTP" when refused before routing: 401)
  absl::Status status;       // OK for any answer a handler gave, else the error
  int http_status = 0;
  double seconds = 0;  // from the end of the headers to the answer
  int64_t bytes_in = 0, bytes_out = 0;
};

struct HttpListenerOptions {
  std::string name = "HTTP";  // for messages
  std::string host = "127.0.0.1";
  int port = 0;     // 0: pick a free port
  int threads = 2;  // epoll threads; connections are spread over them
  int max_connections = 2048;           // at the cap, new connections wait in the backlog
  int max_connections_per_ip = 0;       // 0: no per-address limit
  int max_header_bytes = 16 << 10;      // request line + headers (431 / 414 beyond)
  int max_headers = 100;                // header fields (431 beyond)
  int idle_timeout_s = 30;              // nothing received (or sent) for this long: closed
  int header_timeout_s = 10;            // request line to end of headers; longer: closed
  int body_timeout_s = 300;             // end of headers to end of body; longer: 408
  // An answer not taken this long after it was queued: the connection is closed (a client that
  // reads a little now and then kept the idle timeout from ever passing). 0: no limit.
  int answer_timeout_s = 120;
  // After kMinBodyRateGrace from the headers, a body arriving slower than this on average is
  // cut off (a claim that holds the receive budget must keep coming); 0: no floor.
  int64_t min_body_bytes_per_s = 0;
  std::string tls_cert_file;            // both set: HTTPS
  std::string tls_key_file;
  const BearerAuth* auth = nullptr;     // set: every route but the open ones needs the token
  HttpResponse not_found = HttpResponse::Json(404, R"({"error":"not found"})");
  std::function<void(const HttpCallRecord&)> on_finished;  // may be empty
};

/// Thread-safe. Serves from Start until Stop or destruction.
class HttpListener {
 public:
  static absl::StatusOr<std::unique_ptr<HttpListener>> Start(const HttpListenerOptions& options,
                                                             std::vector<HttpRoute> routes);
  ~HttpListener();
  HttpListener(const HttpListener&) = delete;
  HttpListener& operator=(const HttpListener&) = delete;

  int port() const { return port_; }
  /// Stops listening, lets answers being written finish (up to `finish_answers`), then closes
  /// every connection and joins the threads; idempotent.
  void Stop(absl::Duration finish_answers = absl::Seconds(10));

  struct Impl;  // http_listener.cc

 private:
  HttpListener() = default;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace flashserve
