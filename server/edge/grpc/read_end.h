// How a client-streaming read that ended without a message ended, as far as a handler can tell on
// gRPC 1.51 -- so that the call is counted as what happened to it, not as one status for all:
//  - gRPC failed the read: the stream broke -- the client cancelled or disconnected, its deadline
//    passed, or gRPC reset the stream itself (over --grpc_memory_quota_bytes; the client then sees
//    RESOURCE_EXHAUSTED "Stream removed", which a handler cannot tell from a client's reset).
//    Nobody hears the answer.
//  - gRPC received a message over --max_request_bytes: it drops it, ends the read without an
//    error and cancels the call with RESOURCE_EXHAUSTED "Received message larger than max" -- a
//    cancellation the handler may see only after the read.
//  - the client half-closed its stream.
// The last two look alike when the read ends; a half-closed call found cancelled once gRPC is done
// with it (OnDone) was over the limit (AnsweredCallWasOverSizeLimit).
#pragma once

#include "absl/status/status.h"
#include "grpcpp/server_context.h"

namespace flashserve {

enum class ReadEnd {
  kStreamBroke,     // cancelled, disconnected, or reset by gRPC
  kDeadlinePassed,  // the stream broke past the call's deadline
  kOverSizeLimit,   // gRPC refused a message over --max_request_bytes
  kHalfClosed,      // the client ended its stream (or over the limit, not yet known: see above)
};

ReadEnd ClassifyReadEnd(grpc::CallbackServerContext* context);

/// In OnDone, after the handler answered a kHalfClosed read: gRPC cancelled the call meanwhile, so
/// the answer never went out and the read ended on a message over the limit.
inline bool AnsweredCallWasOverSizeLimit(grpc::CallbackServerContext* context) {
  return context->IsCancelled();
}

/// What a call refused by gRPC over --max_request_bytes is counted as (`what`: the message's name);
/// a compressed one (refused unread, edge/grpc/grpc_edge.cc) ends alike and is counted the same.
absl::Status OverSizeLimitStatus(const char* what);

}  // namespace flashserve
