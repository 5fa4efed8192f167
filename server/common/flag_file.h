// Small files a flag names (a bearer token, a PEM certificate or key), read whole at startup.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace flashserve {

inline constexpr int64_t kMaxTokenFileBytes = int64_t{64} << 10;  // --auth_token_file
inline constexpr int64_t kMaxPemFileBytes = int64_t{1} << 20;     // --tls_cert, --tls_key
inline constexpr int64_t kMaxFlagFileBytes = int64_t{1} << 20;    // --flagfile

/// The contents of the regular file at `path`, of at most `max_bytes`. NOT_FOUND or
/// PERMISSION_DENIED when it cannot be opened, INVALID_ARGUMENT (naming `flag`) when it is not a
/// regular file or is larger: /dev/zero filled memory at 1 GiB/s, a FIFO with no writer hung the
/// start (both with the shutdown signals blocked), a directory read as an empty token.
absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag,
                                         int64_t max_bytes);

}  // namespace flashserve
