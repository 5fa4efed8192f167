// The `method` labels local-socket calls are counted under in flashserve_requests_total and
// flashserve_request_duration_seconds: the gRPC method's name with "Local" in front, so
// operators can tell the transports apart (README "Local socket").
#pragma once

#include <string>
#include <vector>

#include "edge/call/edge_call.h"

namespace flashserve {
namespace local_methods {
inline constexpr CallMethod kHello{"LocalHello"};
inline constexpr CallMethod kEcho{"LocalEcho"};
inline constexpr CallMethod kAttention{"LocalAttention", true};
inline constexpr CallMethod kDecodeStep{"LocalDecodeStep", true};
inline constexpr CallMethod kAttend{"LocalAttend", true};
/// Frames refused before a method was known (bad header, timeout, over the connection cap).
inline constexpr std::string_view kOtherLabel = "LocalOther";
}  // namespace local_methods

/// The labels above, for ServerMetricsOptions::methods (series from startup).
inline std::vector<std::string> LocalMethodLabels() {
  using namespace local_methods;  // NOLINT(build/namespaces)
  std::vector<std::string> labels;
  for (const CallMethod* m : {&kHello, &kEcho, &kAttention, &kDecodeStep, &kAttend}) {
    labels.emplace_back(m->label);
  }
  labels.emplace_back(kOtherLabel);
  return labels;
}

}  // namespace flashserve
