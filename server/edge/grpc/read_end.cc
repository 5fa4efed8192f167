#include "edge/grpc/read_end.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "edge/grpc/grpc_status.h"
#include "grpc/grpc.h"

namespace flashserve {

ReadEnd ClassifyReadEnd(grpc::CallbackServerContext* context) {
  if (grpc_call_failed_before_recv_message(context->c_call()) != 0) {
    return ToAbslTime(context->deadline()) <= absl::Now() ? ReadEnd::kDeadlinePassed
                                                          : ReadEnd::kStreamBroke;
  }
  return context->IsCancelled() ? ReadEnd::kOverSizeLimit : ReadEnd::kHalfClosed;
}

absl::Status OverSizeLimitStatus(const char* what) {
  return absl::ResourceExhaustedError(
      absl::StrCat(what,
                   ": refused by gRPC as larger than --max_request_bytes (\"Received message "
                   "larger than max\"), or as compressed (grpc-encoding gzip or deflate: disabled, "
                   "and gRPC 1.51 does not tell a handler which)"));
}

}  // namespace flashserve
