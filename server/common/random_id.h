// Unguessable ids (striped sessions, sequences): 128 bits from the kernel's CSPRNG as 32 hex characters.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace flashserve {

/// 128 bits from getrandom(2) as 32 lowercase hex characters. UNAVAILABLE, naming `what`, when the
/// kernel's random source fails.
absl::StatusOr<std::string> RandomHexId128(const char* what);

}  // namespace flashserve
