#include "edge/call/edge_call.h"

#include "absl/time/clock.h"
#include "common/client_log.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace flashserve {

namespace {
// Status messages may quote client data (names, ids), escaped at up to 4 characters a byte: 1 KiB
// of a message keeps what the server writes and bounds a line (4 KiB of control bytes made 16 KiB).
constexpr size_t kLoggedMessageBytes = 1024;
}  // namespace

void RecordRefusedCall(ServerMetrics* metrics, std::string_view label, const absl::Status& status) {
  if (metrics != nullptr) {
    metrics->RecordRequest(label, static_cast<int>(status.code()), 0.0, 0, 0);
  }
  // A client without the token is counted, not logged at warn (as HTTP's 401s): one line per call
  // was a log flood anyone reaching the port could cause.
  if (status.code() == absl::StatusCode::kUnauthenticated) {
    spdlog::debug("{} refused: code={} message=\"{}\"", label,
                  absl::StatusCodeToString(status.code()), LogSafe(status.message()));
    return;
  }
  WarnFailure(status.code(), "{} refused: code={} message=\"{}\"", label,
              absl::StatusCodeToString(status.code()),
              LogSafe(status.message(), kLoggedMessageBytes));
}

EdgeCall::EdgeCall(ServerMetrics* metrics, CallMethod method)
    : metrics_(metrics), method_(method) {}

EdgeCall::~EdgeCall() {
  if (inflight_) metrics_->InflightDec();
}

void EdgeCall::Start(int64_t bytes_in) {
  if (started_ != absl::InfinitePast()) return;
  started_ = absl::Now();
  bytes_in_ += bytes_in;
  if (method_.computes && metrics_ != nullptr) {
    metrics_->InflightInc();
    inflight_ = true;
  }
}

void EdgeCall::Finish(const absl::Status& status) {
  if (finished_) {
    spdlog::error("{}: EdgeCall::Finish called twice", method_.label);
    return;
  }
  finished_ = true;
  if (metrics_ != nullptr) {
    if (inflight_) metrics_->InflightDec();
    inflight_ = false;
    const double seconds =
        started_ == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(absl::Now() - started_);
    metrics_->RecordRequest(method_.label, static_cast<int>(status.code()), seconds, bytes_in_,
                            bytes_out_);
  }
  if (!status.ok()) {
    WarnFailure(
        status.code(), "{} failed: request_id=\"{}\"{}{} code={} message=\"{}\"", method_.label,
        LogSafe(request_id_), session_id_.empty() ? "" : " session=", LogSafe(session_id_),
        absl::StatusCodeToString(status.code()), LogSafe(status.message(), kLoggedMessageBytes));
  }
}

}  // namespace flashserve
