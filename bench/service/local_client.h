// A small blocking client for the local transport (proto/flashserve/v1/local_frame.h): one Unix
// stream socket, one call at a time. Each request goes out in one sendmsg (header + payload); the
// reply's header and (up to 64 KiB of) its payload come in one recvmsg, the rest of the payload
// after. With spin_us the client polls for the reply that long before it blocks. Independent of
// the server's code: only the frame header and the generated protos.
//
// Not thread-safe: one LocalClient per thread (the load generators give each worker its own
// connection).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "flashserve/v1/local_frame.h"
#include "google/protobuf/message_lite.h"

namespace flashserve::local {

using v1::local::Method;

/// A call's outcome: `code` is the server's status (google.rpc / absl codes, 0 = OK) or, when the
/// call never got an answer, the client's own: UNAVAILABLE (14) connect / send / receive failed,
/// DEADLINE_EXCEEDED (4) the socket timed out, INTERNAL (13) a malformed or oversized reply.
struct CallStatus {
  int code = 0;
  std::string message;
  bool ok() const { return code == 0; }
  std::string ToString() const { return std::to_string(code) + ": " + message; }
};

struct LocalClientOptions {
  std::string socket_path;
  std::string token;                           // non-empty: a Hello with it right after connecting
  int timeout_ms = 30000;                      // per send / receive on the socket (0: none)
  uint64_t max_reply_bytes = uint64_t(1) << 31;  // larger replies are refused (bounded memory)
  // After sending, poll the socket (non-blocking reads) this long (us) for the reply's first bytes
  // before blocking in recv: a thread blocked in recv on an idle core wakes tens of us after the
  // reply arrives, and the server's sendmsg pays for waking it. The cost: this thread's core, only
  // while its own call is in flight, at most spin_us per call. 0: block at once.
  int64_t spin_us = 0;
};

class LocalClient {
 public:
  /// Connects (and says Hello when options.token is set). nullptr with *error on failure.
  static std::unique_ptr<LocalClient> Connect(const LocalClientOptions& options, CallStatus* error);
  ~LocalClient();
  LocalClient(const LocalClient&) = delete;
  LocalClient& operator=(const LocalClient&) = delete;

  /// Sends `payload` as one frame of `method`; on OK *reply holds the response payload, else the
  /// status carries the server's message. A transport failure leaves the connection unusable
  /// (later calls fail with UNAVAILABLE).
  CallStatus CallBytes(Method method, const void* payload, size_t bytes, std::string* reply);
  CallStatus CallBytes(Method method, const std::string& payload, std::string* reply) {
    return CallBytes(method, payload.data(), payload.size(), reply);
  }

  /// Serializes `request`, calls, and parses the OK reply into `response`.
  CallStatus Call(Method method, const google::protobuf::MessageLite& request,
                  google::protobuf::MessageLite* response);

 private:
  LocalClient(int fd, const LocalClientOptions& options) : fd_(fd), options_(options) {}
  CallStatus Send(Method method, const void* payload, size_t bytes);
  CallStatus Receive(std::string* reply);
  // The first bytes of the reply into head / body: polls for options_.spin_us, then blocks.
  ssize_t ReceiveFirst(unsigned char* head, char* body, size_t body_bytes);
  CallStatus Fail(int code, const std::string& what);

  int fd_ = -1;
  LocalClientOptions options_;
  std::string scratch_;  // serialized requests of Call()
  std::unique_ptr<char[]> first_bytes_;  // a reply's first payload bytes, read with its header
};

}  // namespace flashserve::local
