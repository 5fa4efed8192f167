#include "common/protobuf_errors.h"

#include <climits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/message_lite.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/stubs/logging.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// Set while this thread parses a message: protobuf's complaint becomes the status's reason.
thread_local std::string* parse_reason = nullptr;

constexpr size_t kMaxReasonBytes = 512;

void ToServerLog(google::protobuf::LogLevel level, const char* /*file*/, int /*line*/,
                 const std::string& message) {
  if (parse_reason != nullptr && level < google::protobuf::LOGLEVEL_FATAL) {
    if (parse_reason->empty()) *parse_reason = message.substr(0, kMaxReasonBytes);
    return;
  }
  spdlog::warn("protobuf: {}", LogSafe(message, kMaxReasonBytes));
}

// "String field 'x.Y.z' contains invalid UTF-8 data" without protobuf's advice to schema authors.
absl::string_view ShortReason(absl::string_view reason) {
  const size_t advice = reason.find(" when parsing a protocol buffer");
  if (advice != absl::string_view::npos) reason = reason.substr(0, advice);
  while (!reason.empty() && (reason.back() == ' ' || reason.back() == '.')) reason.remove_suffix(1);
  return reason;
}

absl::Status Malformed(const google::protobuf::MessageLite& message, absl::string_view reason) {
  std::string text = absl::StrCat(message.GetTypeName(), ": malformed protobuf bytes");
  reason = ShortReason(reason);
  if (!reason.empty()) absl::StrAppend(&text, " (", reason, ")");
  return absl::InvalidArgumentError(text);
}

}  // namespace

absl::Status ParseMessage(google::protobuf::io::ZeroCopyInputStream* in,
                          google::protobuf::MessageLite* message) {
  std::string reason;
  parse_reason = &reason;
  const bool parsed = message->ParseFromZeroCopyStream(in);
  parse_reason = nullptr;
  return parsed ? absl::OkStatus() : Malformed(*message, reason);
}

absl::Status ParseMessage(std::string_view bytes, google::protobuf::MessageLite* message) {
  if (bytes.size() > size_t(INT_MAX)) return Malformed(*message, "over 2 GiB");
  google::protobuf::io::ArrayInputStream in(bytes.data(), int(bytes.size()));
  return ParseMessage(&in, message);
}

void RouteProtobufLogs() { google::protobuf::SetLogHandler(&ToServerLog); }

}  // namespace flashserve
