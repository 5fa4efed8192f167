// What every call of a transport edge shares, whatever the transport: its `method` label, the
// request metrics and the log line of a failure, all on absl::Status. The gRPC edge wraps it in
// GrpcCall (edge/grpc/grpc_call.h: method paths, the grpc::Status to finish with); the local
// socket uses it as it is (edge/local/local_methods.h names its labels). The HTTP edge does not:
// its listener (common/http_listener.h, a layer below) times and logs each request itself and
// hands the record to ServerMetrics::RecordRequest.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "metrics/server_metrics.h"

namespace flashserve {

/// A method as the metrics see it: its `method` label, and whether its calls hand a request to
/// the runtime (those count in flashserve_inflight_requests while they run).
struct CallMethod {
  std::string_view label;
  bool computes = false;
};

/// A call refused before any handler ran (a token gate, a bad frame): requests_total{method,
/// status} += 1 with zero duration and bytes, and one warning line. `metrics` may be null.
void RecordRefusedCall(ServerMetrics* metrics, std::string_view label, const absl::Status& status);

/// One call's bookkeeping, from the handler's first look at it to Finish. Not thread-safe: one
/// owner at a time (a reactor, the runtime's done callback, a connection's thread, in turn).
class EdgeCall {
 public:
  /// `metrics` may be null (then nothing is recorded; failures are still logged).
  EdgeCall(ServerMetrics* metrics, CallMethod method);
  /// A call never finished (its handler was torn down first) leaves inflight_requests as it was.
  ~EdgeCall();
  EdgeCall(const EdgeCall&) = delete;
  EdgeCall& operator=(const EdgeCall&) = delete;

  /// The request is complete (unary) or the call has begun (streams): request_duration_seconds
  /// is measured from here (0 for a call that fails before), `bytes` count as received, and a
  /// computing method counts in inflight_requests until Finish. At most once.
  void Start(int64_t bytes_in = 0);
  /// When Start was called; InfinitePast before.
  absl::Time started() const { return started_; }
  void AddBytesIn(int64_t bytes) { bytes_in_ += bytes; }
  void AddBytesOut(int64_t bytes) { bytes_out_ += bytes; }
  int64_t bytes_in() const { return bytes_in_; }
  /// Named in the failure log line: the request's id, a stream's session.
  void set_request_id(std::string_view id) { request_id_.assign(id.substr(0, 256)); }
  void set_session_id(std::string_view id) { session_id_.assign(id.substr(0, 64)); }

  /// Ends the call's bookkeeping: requests_total{method,status} += 1, the duration, the bytes
  /// (sent only when `status` is ok), a warning line for a failure. Exactly once.
  void Finish(const absl::Status& status);
  bool finished() const { return finished_; }

 private:
  ServerMetrics* const metrics_;
  const CallMethod method_;
  absl::Time started_ = absl::InfinitePast();
  int64_t bytes_in_ = 0;
  int64_t bytes_out_ = 0;
  std::string request_id_;
  std::string session_id_;
  bool inflight_ = false;
  bool finished_ = false;
};

}  // namespace flashserve
