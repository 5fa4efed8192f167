// The KServe v2 / Open Inference Protocol REST API on the HTTP edge (port 8000), with the binary
// tensor data extension:
//   GET  /v2                                      server metadata
//   GET  /v2/models/<model>[/versions/<v>]        model metadata
//   GET  /v2/models/<model>[/versions/<v>]/ready  model readiness (200 / 503)
//   POST /v2/models/<model>[/versions/<v>]/infer  inference (JSON and/or binary tensors)
// (/v2/health/live and /v2/health/ready are the HTTP edge's own.) Errors are
// {"error": "..."} with the HTTP status of kserve::HttpStatusFor.
#pragma once

#include "edge/http/kserve_json.h"
#include "runtime/attention_runtime.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace flashserve {

/// Adds the routes to `server` (before it listens). `runtime` must outlive the server. The
/// handlers are thread-safe; an infer handler blocks its HTTP thread until the answer is ready.
void RegisterKServeRoutes(httplib::Server& server, AttentionRuntime* runtime,
                          const kserve::KServeOptions& options);

}  // namespace flashserve
