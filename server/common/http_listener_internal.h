// Inside HttpListener (common/http_listener.h): the per-connection and per-request state shared by
// the middleware (http_listener.cc) and the libmicrohttpd daemon (http_listener_daemon.cc).
// Not for use elsewhere.
#pragma once

#include <microhttpd.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/http_listener.h"

namespace flashserve::http_internal {

// Body bytes read and dropped past the size limit before a refused upload is cut off.
inline constexpr int64_t kDrainBytes = int64_t{16} << 20;

// Where a connection is, for the timeout sweeper.
// kBusy: computing; kSending: the answer is queued and leaves as fast as the client reads it.
enum class Phase { kAwaiting, kHeaders, kBody, kBusy, kSending };

struct ConnectionState {
  int fd = -1;
  Phase phase = Phase::kAwaiting;
  absl::Time since = absl::Now();
  int64_t body_bytes = 0;  // received in this kBody phase
  // Why the sweeper shut the connection down (a timeout, the body rate floor, eviction at the
  // connection cap: DEADLINE_EXCEEDED); OK if it did not. A request it leaves unanswered is
  // counted with it, not as CANCELLED (the client's doing).
  absl::Status cut_because;
};

// A suspended request's answer, handed over from whichever thread computes it.
struct PendingAnswer {
  std::mutex mu;
  MHD_Connection* connection = nullptr;  // null once the request is over (closed, shut down)
  int fd = -1;  // the connection's socket; read only while suspended (libmicrohttpd's after)
  std::optional<HttpAnswer> answer;
  bool resumed = false;  // the answer is in and the connection resumed: exactly once

  // HttpPeerGone: whether the client closed or reset the connection.
  bool PeerGone();
};

struct CompiledRoute {
  HttpRoute route;
  std::regex pattern;
};

struct RequestState {
  bool begun = false;  // headers in, the middleware ran
  bool answered = false;
  const CompiledRoute* route = nullptr;
  absl::Time started;  // end of the headers
  int64_t bytes_in = 0;
  std::unique_ptr<HttpUpload> upload;
  absl::Status failed;  // the upload was refused: the rest of the body is dropped
  absl::Status closed_because;  // why the connection was cut off without an answer
  std::shared_ptr<PendingAnswer> pending;  // set once OnComplete ran
  std::vector<std::string> get_matches;    // a GET route's groups, until it is answered
};

}  // namespace flashserve::http_internal

namespace flashserve {

using http_internal::CompiledRoute;
using http_internal::kDrainBytes;
using http_internal::PendingAnswer;
using http_internal::ConnectionState;
using http_internal::Phase;
using http_internal::RequestState;

struct HttpListener::Impl {
  HttpListenerOptions options;
  std::vector<CompiledRoute> routes;
  MHD_Daemon* daemon = nullptr;
  std::string tls_cert, tls_key;  // must outlive the daemon

  std::mutex mu;  // guards connections, suspended and stop
  std::set<ConnectionState*> connections;
  // Requests waiting suspended for their answer. libmicrohttpd aborts the process when it is
  // stopped with a connection suspended, so Stop answers these first (AnswerSuspended).
  std::set<std::shared_ptr<PendingAnswer>> suspended;
  bool stop = false;
  std::condition_variable stop_cv;
  std::thread sweeper;

  // The timeouts (http_listener_daemon.cc).
  void SetPhase(MHD_Connection* connection, Phase phase);
  void AddBodyBytes(MHD_Connection* connection, int64_t bytes);
  // Whether a connection in kBody for `elapsed` with `bytes` received falls under
  // --http_min_body_bytes_per_s (after kMinBodyRateGrace unless `at_the_cap`).
  bool BodyStalled(absl::Duration elapsed, int64_t bytes, bool at_the_cap) const;
  // DEADLINE_EXCEEDED (408) for a body cut off under --http_min_body_bytes_per_s.
  absl::Status BodyTooSlowError(absl::Duration elapsed, int64_t bytes) const;
  void Sweep();
  void EvictAtTheCap(absl::Time now);  // under mu
  // Shuts a connection's socket down with the reason (ConnectionState::cut_because); under mu.
  void CutOff(ConnectionState* c, absl::Status why);
  // The connection's cut_because (OK: the sweeper did not cut it).
  absl::Status CutReason(MHD_Connection* connection);
  // Answers every request still suspended with `answer` and waits (up to `wait`) until each is
  // resumed and answered or its connection closed (http_listener_daemon.cc).
  void AnswerSuspended(const HttpAnswer& answer, absl::Duration wait);
  void Unsuspend(const std::shared_ptr<PendingAnswer>& pending);

  // The middleware (http_listener.cc).
  // The methods the routes serve at `path` ("GET, HEAD", "POST", ...; empty: no route there).
  std::string AllowedMethods(const std::string& path) const;
  const CompiledRoute* Find(absl::string_view method, const std::string& path,
                            std::vector<std::string>* matches) const;
  absl::Status CheckHeaders(MHD_Connection* connection) const;
  // Sets *has_body when the request announces a body (a Content-Length other than 0, or a
  // Transfer-Encoding).
  absl::Status CheckFraming(MHD_Connection* connection, bool* has_body) const;
  MHD_Result Respond(MHD_Connection* connection, RequestState* st, HttpAnswer answer,
                     absl::string_view metric, int forced_status = 0);
  // 400 naming `why`, with the connection closed after it.
  MHD_Result RefuseAndClose(MHD_Connection* connection, RequestState* st, absl::string_view why);
  // The request's metrics record (`metric` empty: none) and the log line of a failure;
  // http_status 0: the connection closed before an answer was written.
  void Report(const RequestState& st, absl::string_view metric, const absl::Status& status,
              int http_status, int64_t bytes_out);
  MHD_Result Begin(MHD_Connection* connection, const char* url, const char* method,
                   RequestState* st);
  MHD_Result Body(MHD_Connection* connection, RequestState* st, absl::string_view piece);
  MHD_Result Finish(MHD_Connection* connection, const char* url, const char* method,
                    RequestState* st);
};

}  // namespace flashserve
