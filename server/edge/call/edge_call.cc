#include "edge/call/edge_call.h"

#include "absl/time/clock.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace flashserve {

namespace {
// Status messages may quote client data (names, ids); 4 KiB covers the longest the server writes.
constexpr size_t kLoggedMessageBytes = 4096;
}  // namespace

void RecordRefusedCall(ServerMetrics* metrics, std::string_view label, const absl::Status& status) {
  if (metrics != nullptr) {
    metrics->RecordRequest(label, static_cast<int>(status.code()), 0.0, 0, 0);
  }
  spdlog::warn("{} refused: code={} message=\"{}\"", label, absl::StatusCodeToString(status.code()),
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
    spdlog::warn("{} failed: request_id=\"{}\"{}{} code={} message=\"{}\"", method_.label,
                 LogSafe(request_id_), session_id_.empty() ? "" : " session=", LogSafe(session_id_),
                 absl::StatusCodeToString(status.code()),
                 LogSafe(status.message(), kLoggedMessageBytes));
  }
}

}  // namespace flashserve
