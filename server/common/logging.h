// Process-wide log setup (spdlog): level and text or JSON-lines format.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace flashserve {

/// level: trace, debug, info, warn, error, critical, off. format: text or json (one JSON object
/// per line with time, level, thread and msg, for log shippers). Call once, before other threads
/// log.
absl::Status ConfigureLogging(absl::string_view level, absl::string_view format);

}  // namespace flashserve

namespace flashserve {

/// A client-supplied string fit for a log line: at most `max_bytes` of it, non-printable bytes as
/// \xNN, quotes and backslashes escaped (request ids, and messages quoting client data, are
/// arbitrary bytes: a raw newline would forge a log line).
std::string LogSafe(absl::string_view text, size_t max_bytes = 128);

}  // namespace flashserve
