// Status conversion of the HTTP middleware (common/http_listener.h): absl::Status -> HTTP code.
// Header-only, so that code which only converts (the REST JSON fuzz target) needs no HTTP server.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace flashserve {

/// How the HTTP listener's refusal of a body over its route's limit begins.
inline constexpr absl::string_view kBodyOverLimit = "request body exceeds ";

/// HTTP status for a failed request: 400 INVALID_ARGUMENT / FAILED_PRECONDITION / OUT_OF_RANGE,
/// 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 NOT_FOUND, 408 DEADLINE_EXCEEDED while the
/// request was still being received (HttpTimeoutError), 413 RESOURCE_EXHAUSTED naming a size limit
/// flag (--max_tensor_elements, --max_request_bytes, --http_max_json_bytes) or a body over its
/// route's limit (kBodyOverLimit), 503 other
/// RESOURCE_EXHAUSTED (queue full, in-flight bytes, device memory, receive budget: overload) and
/// UNAVAILABLE / CANCELLED / ABORTED, 504 DEADLINE_EXCEEDED, 501 UNIMPLEMENTED, 500 otherwise.
inline int HttpStatusFor(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:  // a shared-memory region's name taken (as Triton)
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      // A request over a configured size limit (the message names the flag) is 413 whatever the
      // server's load; every other RESOURCE_EXHAUSTED is overload: 503, retry later.
      for (const char* flag :
           {"--max_tensor_elements", "--max_request_bytes", "--http_max_json_bytes"}) {
        if (absl::StrContains(status.message(), flag)) return 413;
      }
      // A route's own body limit (http_listener.h's body_limit_flag may name no flag).
      return absl::StartsWith(status.message(), kBodyOverLimit) ? 413 : 503;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kAborted:
      return 503;
    case absl::StatusCode::kDeadlineExceeded:
      return absl::StartsWith(status.message(), "request timeout:") ? 408 : 504;
    case absl::StatusCode::kUnimplemented:
      return 501;
    default:
      return 500;
  }
}

/// DEADLINE_EXCEEDED for a request whose body did not arrive in time (408, not 504).
inline absl::Status HttpTimeoutError(absl::string_view what) {
  return absl::DeadlineExceededError(absl::StrCat("request timeout: ", what));
}

}  // namespace flashserve
