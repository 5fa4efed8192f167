// The local transport's cells of flashserve-loadgen (--local_socket=PATH): the same request shapes
// over frames on a Unix socket (local_client.h) instead of gRPC, one connection per worker:
//   * the floor: Echo frames, tiny (64 B) and of each cell's own request bytes;
//   * inline: AttentionRequest with the tensor bytes in the frame (only requests that fit
//     --local_max_frame_bytes: the small shape);
//   * system / cuda shared memory: AttentionRequest with Tensor.shm references (Q, K, V back to back
//     in one region, O into another via out_shm), regions registered over KServe gRPC exactly as
//     the gRPC shm cells do (loadgen_regions.h); the server needs --allow_client_shm.
// Same columns as the gRPC shm table, plus the issue-18 targets computed from the c=1 rows.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "loadgen_workload.h"

namespace flashserve::loadgen {

struct LocalSectionOptions {
  std::string socket_path, token;
  std::vector<std::string> shm_paths;  // "system", "cuda"; may be empty (echo + inline only)
  std::vector<int> concurrency;
  double duration_s = 2;
  int min_requests = 3;
  int large_max_concurrency = 16;
  int device = 0;                              // cuda regions
  uint64_t max_frame_bytes = uint64_t(8) << 20;  // the server's --local_max_frame_bytes default
  int timeout_ms = 60000;
  int64_t client_spin_us = 0;  // LocalClientOptions::spin_us of every cell's clients
};

/// Runs the section; `server` (gRPC) registers the regions. Rows go to `csv` (targets "local_*")
/// and the returned markdown.
std::string RunLocalSection(Pool* server, const std::vector<std::unique_ptr<Workload>>& workloads,
                            const LocalSectionOptions& options, std::ostream& csv);

}  // namespace flashserve::loadgen
