// Sequence ids: 128 bits from getrandom(2) as 32 hex characters, so ids cannot be guessed.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace flashserve::kvcache {

/// UNAVAILABLE when the kernel's random source fails.
absl::StatusOr<std::string> NewSequenceId();

/// Whether `id` has the shape NewSequenceId gives: 32 lowercase hex characters. An id of any other
/// shape was never issued, so it is unknown (NOT_FOUND) like any other, but it is client data of
/// any length and bytes: it is never echoed raw into a status message, log line or gRPC metadata
/// (a newline in trailing metadata made gRPC abort the server).
bool WellFormedSequenceId(std::string_view id);

/// `id` as a message names it: itself when well-formed, else "a malformed id (N bytes)".
std::string ShownSequenceId(std::string_view id);

}  // namespace flashserve::kvcache
