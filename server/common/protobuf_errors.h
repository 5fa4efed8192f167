// Protobuf's errors as the server reports them. A request that does not parse is INVALID_ARGUMENT
// naming the message and, where protobuf said why, the field; protobuf's own log lines (it logs a
// string field that is not UTF-8 at every parse) go through the server's logger, so --log_format
// json stays one JSON object per line.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace google::protobuf {
class MessageLite;
namespace io {
class ZeroCopyInputStream;
}
}  // namespace google::protobuf

namespace flashserve {

/// Parses `in` (or `bytes`) into `message`. On failure: INVALID_ARGUMENT "<type>: malformed
/// protobuf bytes" (truncated, not protobuf) with protobuf's reason when it gave one, e.g.
/// "(String field 'flashserve.v1.AttendRequest.sequence_id' contains invalid UTF-8 data ...)".
/// That reason is not logged separately.
absl::Status ParseMessage(google::protobuf::io::ZeroCopyInputStream* in,
                          google::protobuf::MessageLite* message);
absl::Status ParseMessage(std::string_view bytes, google::protobuf::MessageLite* message);

/// From now on protobuf's log lines go to spdlog (warning level, escaped, at most 512 bytes).
/// Called by ConfigureLogging.
void RouteProtobufLogs();

}  // namespace flashserve
