// The `method` labels local-socket calls are counted under in flashserve_requests_total and
// flashserve_request_duration_seconds: the gRPC method's name with "Local" in front, so
// operators can tell the transports apart (README "Local socket").
#pragma once

#include <string>
#include <vector>

#include "edge/grpc/grpc_call.h"

namespace flashserve {
namespace local_methods {
// Paths are not used (no gRPC routing); the labels are.
inline constexpr GrpcMethod kHello{"local:Hello", "LocalHello"};
inline constexpr GrpcMethod kEcho{"local:Echo", "LocalEcho"};
inline constexpr GrpcMethod kAttention{"local:Attention", "LocalAttention", true};
inline constexpr GrpcMethod kDecodeStep{"local:DecodeStep", "LocalDecodeStep", true};
inline constexpr GrpcMethod kAttend{"local:Attend", "LocalAttend", true};
/// Frames refused before a method was known (bad header, timeout, over the connection cap).
inline constexpr std::string_view kOtherLabel = "LocalOther";
}  // namespace local_methods

/// The labels above, for ServerMetricsOptions::methods (series from startup).
inline std::vector<std::string> LocalMethodLabels() {
  using namespace local_methods;  // NOLINT(build/namespaces)
  std::vector<std::string> labels;
  for (const GrpcMethod* m : {&kHello, &kEcho, &kAttention, &kDecodeStep, &kAttend}) {
    labels.emplace_back(m->label);
  }
  labels.emplace_back(kOtherLabel);
  return labels;
}

}  // namespace flashserve
