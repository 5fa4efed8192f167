// Answers handed to gRPC that a client does not take. gRPC keeps an unsent answer -- and the
// buffers its slices point into -- until the client's HTTP/2 window lets it out, with no time limit
// of its own: a client that opens no window held every answer it asked for (+5.4 MiB per 4 MiB
// call, 1.6 GiB for 300, one connection). So the tensor-carrying reactors keep their call's
// --max_inflight_bytes reservation until gRPC has finished the call (LiveCall::AnswerHandedOver),
// and this watch cancels a call whose answer has not left within --answer_timeout_s.
#pragma once

#include <memory>
#include <mutex>

#include "absl/time/time.h"

namespace grpc {
class ServerContextBase;
}  // namespace grpc

namespace flashserve {

/// Process-wide; thread-safe. Started and stopped by the gRPC edge (one per process).
class AnswerWatch {
 public:
  /// Cancels watched calls `timeout` after their answer was handed over (zero: never).
  static void Start(absl::Duration timeout);
  /// Stops watching (calls watched later are not). After the server has shut down.
  static void Stop();

  struct Entry;
  /// Watches one call until destroyed (in the reactor's OnDone, when gRPC is done with it).
  class Token {
   public:
    Token() = default;
    explicit Token(std::shared_ptr<Entry> entry) : entry_(std::move(entry)) {}
    Token(Token&&) = default;
    Token& operator=(Token&& other) noexcept;
    Token(const Token&) = delete;
    Token& operator=(const Token&) = delete;
    ~Token() { Forget(); }

   private:
    void Forget();
    std::shared_ptr<Entry> entry_;
  };
  /// From now; an empty token when the watch is not running.
  static Token Watch(grpc::ServerContextBase* context);
  /// Calls cancelled by the watch since the process started.
  static int64_t cancelled();
};

}  // namespace flashserve
