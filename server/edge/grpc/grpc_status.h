// The conversions between gRPC and Abseil types every gRPC edge needs: status (the codes share
// numbering) and a call's deadline.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/support/status.h"

namespace flashserve {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

/// A call's deadline (ServerContext::deadline()); "no deadline" (time_point::max) is infinite.
inline absl::Time ToAbslTime(std::chrono::system_clock::time_point t) {
  if (t >= std::chrono::system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(t);
}

}  // namespace flashserve
