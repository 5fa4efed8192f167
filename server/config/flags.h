// The server's command-line flags: declared (ABSL_FLAG) and read only in flags.cc, and turned
// there into one ServerConfig. Nothing else in server/ reads a flag.
#pragma once

#include <optional>

#include "absl/status/statusor.h"
#include "config/server_config.h"

namespace flashserve {

/// Sets up --help/--version and parses argv (Abseil exits on an unknown flag or a value of the
/// wrong type). Returns an exit code when the process should exit at once (--help: 0).
std::optional<int> ParseServerFlags(int argc, char** argv);

/// The flags' current values as a checked ServerConfig: INVALID_ARGUMENT naming the flag of the
/// first bad value. Reads $FLASHSERVE_AUTH_TOKEN when --auth_token_file is empty.
absl::StatusOr<ServerConfig> ServerConfigFromFlags();

/// A refused configuration, logged on stderr in the --log_level / --log_format asked for when
/// those two are valid (else plain text): before this, it went to stdout as plain text.
void ReportConfigError(const absl::Status& status);

}  // namespace flashserve
