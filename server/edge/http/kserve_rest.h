// The KServe v2 / Open Inference Protocol REST API on the HTTP edge (port 8000), with the binary
// tensor data extension:
//   GET  /v2                                      server metadata
//   GET  /v2/models/<model>[/versions/<v>]        model metadata
//   GET  /v2/models/<model>[/versions/<v>]/ready  model readiness (200 / 503)
//   POST /v2/models/<model>[/versions/<v>]/infer  inference (JSON and/or binary tensors)
// (/v2/health/live and /v2/health/ready are the HTTP edge's own.) Errors are
// {"error": "..."} with the HTTP status of HttpStatusFor (common/http_listener.h).
//
// An infer body is read as it arrives: its JSON header (at most --http_max_json_bytes, scanned
// for depth and value count before it is parsed), then the binary inputs straight into their
// tensors, which are allocated only once the header's shapes, dtypes and sizes passed
// ValidateAttentionRequest and the edge's receive budget (--http_max_receive_bytes) had room.
#pragma once

#include <vector>

#include "common/http_listener.h"
#include "edge/http/infer_body.h"
#include "edge/http/kserve_json.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

/// The routes, for the HTTP edge's listener. `runtime` must outlive the listener. Inferences
/// never hold a listener thread while they compute.
std::vector<HttpRoute> KServeRestRoutes(AttentionRuntime* runtime,
                                        const kserve::KServeOptions& options,
                                        const KServeRestLimits& limits);

}  // namespace flashserve
