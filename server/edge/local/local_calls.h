// The local socket's computing methods: a request frame's payload in, the response's bytes out.
// Each runs the call exactly as the gRPC edge does (Attention: AttentionRuntime::Submit with the
// payload's tensors read in place and O/LSE sent from the request buffers, shared memory resolved
// for the same owner; DecodeStep / Attend: BuildDecodeStep / BuildAttend and
// SequenceRuntime::Submit with the bytes reserved), then waits on the connection's thread for
// done() (edge/local/call_waiter.h: polling, short sleeps, then a futex). No hand-off to another
// thread.
#pragma once

#include <sys/uio.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "api/response_wire.h"
#include "memory/heap_retention.h"
#include "memory/io_buffers.h"
#include "runtime/attention_runtime.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {

/// What the calls need of the server; borrowed, outlive the connections.
struct LocalServices {
  AttentionRuntime* runtime = nullptr;
  SequenceRuntime* sequences = nullptr;  // null: the server runs without a KV cache
  absl::Duration spin;                   // --local_spin_us
  HeapRetention* heap_retention = nullptr;  // told of every DecodeStep; may be null
};

/// One call's answer: an error, or the response message's bytes as pieces (which may point into
/// `io`, the request buffers O and LSE were computed in, or into `bytes` / `wire`).
struct LocalReply {
  absl::Status status;
  std::string bytes;
  ResponsePieces wire;
  std::shared_ptr<IoBuffers> io;
  std::vector<iovec> pieces;
  // What the call still holds once its answer is ready (a DecodeStep's arena, the runtime's call
  // record, its reserved bytes): freed after the answer is written, so that freeing ~1,000
  // messages is not in the client's wait. Never a lease on a client's region: those are given
  // back before the answer.
  std::shared_ptr<void> after_write;
  void AddPiece(std::string_view piece) {
    if (!piece.empty()) pieces.push_back({const_cast<char*>(piece.data()), piece.size()});
  }
};

/// Everything one call is given by its connection. `payload` stays valid until the function
/// returns; `peer_gone` says whether the client has left (the runtime then drops the call).
struct LocalCall {
  std::string_view payload;
  AttentionRuntime::Admission admission;  // taken when the frame's header arrived
  std::function<bool()> peer_gone;
  absl::Time received;
};

void ServeLocalAttention(const LocalServices& services, LocalCall call, LocalReply* reply);
void ServeLocalDecodeStep(const LocalServices& services, LocalCall call, LocalReply* reply);
void ServeLocalAttend(const LocalServices& services, LocalCall call, LocalReply* reply);

}  // namespace flashserve
