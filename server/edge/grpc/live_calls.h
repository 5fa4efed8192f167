// Calls carrying tensor data -- native Attention, KServe ModelInfer, striped uploads and downloads,
// Sequences Attend and DecodeStep -- that gRPC has not finished yet, counted process-wide. The
// SIGTERM drain waits for them once the runtime is idle: an answer already handed to gRPC may still
// be on its way to a slow reader, and gRPC's Shutdown deadline would cut it off
// (tests/python/test_drain_slow_reader.py).
#pragma once

#include <atomic>
#include <cstdint>

#include "grpcpp/support/server_callback.h"

namespace flashserve {

/// One live call, from construction to destruction: a member of the object gRPC destroys when it
/// has finished the call (a reactor). Thread-safe.
class LiveCall {
 public:
  LiveCall() { count_.fetch_add(1); }
  ~LiveCall() { count_.fetch_sub(1); }
  LiveCall(const LiveCall&) = delete;
  LiveCall& operator=(const LiveCall&) = delete;

  /// Live calls now: 0 once the server is shut down, or reactors leak.
  static int64_t count() { return count_.load(); }

 private:
  static inline std::atomic<int64_t> count_{0};
};

/// The reactor of a unary call whose answer carries tensor data (ModelInfer, Attend, DecodeStep):
/// a live call until gRPC has written the answer. Their admission ends in the runtime's done
/// callback, before an answer of up to gigabytes has left: without this the drain found the
/// runtime idle and gRPC's shutdown deadline cut such answers off.
class LiveUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  void OnDone() override { delete this; }

 private:
  LiveCall live_;
};

}  // namespace flashserve
