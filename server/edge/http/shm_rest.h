// Triton's shared-memory extension on the HTTP edge (regions: memory/shm_regions.h):
//   GET  /v2/systemsharedmemory[/region/<name>]/status       [{"name","key","offset","byte_size"}]
//   POST /v2/systemsharedmemory/region/<name>/register       {"key","offset","byte_size"}
//   POST /v2/systemsharedmemory[/region/<name>]/unregister
//   GET  /v2/cudasharedmemory[/region/<name>]/status         [{"name","device_id","byte_size"}]
//   POST /v2/cudasharedmemory/region/<name>/register         {"raw_handle":{"b64"},"device_id","byte_size"}
//   POST /v2/cudasharedmemory[/region/<name>]/unregister
// All refused (403) unless the server runs with --allow_client_shm.
#pragma once

#include <vector>

#include "common/http_listener.h"
#include "runtime/attention_runtime.h"

namespace flashserve {

/// The routes; `runtime` (and its region registry) must outlive the listener.
std::vector<HttpRoute> ShmRestRoutes(AttentionRuntime* runtime);

}  // namespace flashserve
