// Calls carrying tensor data -- native Attention, KServe ModelInfer, striped uploads and downloads,
// Sequences Attend and DecodeStep -- that gRPC has not finished yet, counted process-wide. The
// SIGTERM drain waits for them once the runtime is idle: an answer already handed to gRPC may still
// be on its way to a slow reader, and gRPC's Shutdown deadline would cut it off
// (tests/python/test_drain_slow_reader.py).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "edge/grpc/answer_watch.h"
#include "grpcpp/support/server_callback.h"

namespace flashserve {

/// One live call, from construction to destruction: a member of the object gRPC destroys when it
/// has finished the call (a reactor). Thread-safe.
class LiveCall {
 public:
  LiveCall() { count_.fetch_add(1); }
  ~LiveCall() {
    watch_ = AnswerWatch::Token();  // before `keep_`: the watch never cancels a finished call
    keep_.reset();
    count_.fetch_sub(1);
  }
  LiveCall(const LiveCall&) = delete;
  LiveCall& operator=(const LiveCall&) = delete;

  /// The call's answer goes to gRPC now (call before Finish: gRPC may destroy the reactor right
  /// after): `keep` -- its bytes' reservation against --max_inflight_bytes -- stays until gRPC has
  /// finished the call, so answers a client does not read still count, and AnswerWatch cancels the
  /// call if the answer has not left within --answer_timeout_s. Once per call.
  void AnswerHandedOver(grpc::ServerContextBase* context, std::shared_ptr<void> keep) {
    keep_ = std::move(keep);
    watch_ = AnswerWatch::Watch(context);
  }

  /// A streamed answer's next write goes to gRPC now: the watch cancels the call if this write
  /// has not left within --answer_timeout_s (each write gets its own period; the last one's ends).
  void WriteHandedOver(grpc::ServerContextBase* context) {
    watch_ = AnswerWatch::Watch(context);
  }

  /// Live calls now: 0 once the server is shut down, or reactors leak.
  static int64_t count() { return count_.load(); }

 private:
  static inline std::atomic<int64_t> count_{0};
  std::shared_ptr<void> keep_;
  AnswerWatch::Token watch_;
};

/// The reactor of a unary call whose answer carries tensor data (ModelInfer, Attend, DecodeStep):
/// a live call until gRPC has written the answer. Their admission ends in the runtime's done
/// callback, before an answer of up to gigabytes has left: without this the drain found the
/// runtime idle and gRPC's shutdown deadline cut such answers off.
class LiveUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  void OnDone() override { delete this; }
  /// LiveCall::AnswerHandedOver: call before Finish.
  void AnswerHandedOver(grpc::ServerContextBase* context, std::shared_ptr<void> keep) {
    live_.AnswerHandedOver(context, std::move(keep));
  }
  /// AnswerHandedOver, then Finish.
  void FinishAnswer(grpc::ServerContextBase* context, std::shared_ptr<void> keep,
                    const grpc::Status& status) {
    AnswerHandedOver(context, std::move(keep));
    Finish(status);
  }

 private:
  LiveCall live_;
};

}  // namespace flashserve
