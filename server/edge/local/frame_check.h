// The local transport's request headers, checked before anything is allocated for the payload
// (proto/flashserve/v1/local_frame.h is the format). No socket here: the fuzzer and the unit
// tests run it on bytes.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "flashserve/v1/local_frame.h"

namespace flashserve {

/// The method label of a request frame ("Hello", "Echo", "Attention", "DecodeStep", "Attend"),
/// or empty for an unknown method number.
std::string_view LocalMethodName(uint16_t method);

/// OK when `header` is a request this server serves: magic "FSL1", a known method, flags and
/// reserved 0, at most `max_payload_bytes` of payload. Else INVALID_ARGUMENT (bad magic, method,
/// flags) or RESOURCE_EXHAUSTED (too long), naming what was wrong; the connection is then closed.
absl::Status CheckRequestHeader(const v1::local::FrameHeader& header, int64_t max_payload_bytes);

/// One whole request frame in `bytes` (header and payload, nothing after): its checked header
/// and its payload. For tests and the fuzzer; the server reads the same way from a socket.
absl::Status SplitRequestFrame(std::string_view bytes, int64_t max_payload_bytes,
                               v1::local::FrameHeader* header, std::string_view* payload);

}  // namespace flashserve
