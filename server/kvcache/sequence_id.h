// Sequence ids: 128 bits from getrandom(2) as 32 hex characters, so ids cannot be guessed.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace flashserve::kvcache {

/// UNAVAILABLE when the kernel's random source fails.
absl::StatusOr<std::string> NewSequenceId();

}  // namespace flashserve::kvcache
