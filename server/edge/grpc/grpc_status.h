// The conversions between gRPC and Abseil types every gRPC edge needs: status (the codes share
// numbering) and a call's deadline.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/utf8.h"
#include "grpcpp/support/status.h"

namespace flashserve {

/// A status message travels in a trailer, and clients refuse trailers past their metadata limit
/// (8 KiB by default, all of a response's trailers together): a message quoting a huge client
/// string (a 1 MiB model name) reached the client as RESOURCE_EXHAUSTED instead of its own code.
/// Messages are cut to this many bytes on the wire, where gRPC percent-encodes every byte outside
/// 0x20..0x7E and '%' (3 bytes each); the rest of the budget is left to other trailers.
inline constexpr size_t kMaxGrpcMessageWireBytes = 3072;

/// The longest prefix of `message` whose percent-encoding fits `wire_bytes`, on a UTF-8 boundary.
inline std::string_view GrpcMessagePrefix(std::string_view message, size_t wire_bytes) {
  size_t cost = 0, n = 0;
  for (; n < message.size(); ++n) {
    const auto c = static_cast<unsigned char>(message[n]);
    cost += (c < 0x20 || c > 0x7e || c == '%') ? 3 : 1;
    if (cost > wire_bytes) break;
  }
  return Utf8Prefix(message, n);
}

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const std::string_view full(status.message().data(), status.message().size());
  std::string message(GrpcMessagePrefix(full, kMaxGrpcMessageWireBytes));
  if (message.size() < full.size()) absl::StrAppend(&message, "... (cut, ", full.size(), " bytes)");
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

/// A call's deadline (ServerContext::deadline()); "no deadline" (time_point::max) is infinite.
inline absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(t);
}

}  // namespace flashserve
