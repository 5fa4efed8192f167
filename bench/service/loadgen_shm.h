// Shared-memory paths of the load generator (Triton's shared-memory extension, --shm=system,cuda):
// the workload's Q, K and V put once into a region of the load generator's own (system: a POSIX
// shm object; cuda: cudaMalloc'd memory shared by its IPC handle, CUDA builds only), registered
// with the server over KServe gRPC, and a ModelInfer request naming it, O written into another
// region. Every worker sends the same request (its O region is shared: the bytes written there
// race between workers, which does not matter to the timing). Server timing comes from the
// response's parameters (the response carries no tensor bytes).
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "loadgen_cell.h"
#include "loadgen_workload.h"

namespace flashserve::loadgen {

struct ShmSectionOptions {
  std::vector<std::string> paths;  // "system", "cuda"
  std::vector<int> concurrency;
  double duration_s = 2;
  int min_requests = 3;
  int large_max_concurrency = 16;
  int device = 0;  // cuda: where the regions are
};

/// Runs every workload over every path and concurrency on `server` (the pool's first channel
/// registers the regions); rows go to `csv` (target "shm_<path>") and the returned markdown.
std::string RunShmSection(Pool* server, const std::vector<std::unique_ptr<Workload>>& workloads,
                          const ShmSectionOptions& options, std::ostream& csv);

struct Region;

/// Puts the workload's Q, K, V into region `in`, back to back (the layout every shm cell uses).
bool FillQkv(const Workload& w, Region* in, std::string* error);

/// The shm table's header and one cell's row of it (also its CSV row, loadgen.cc's columns with
/// goodput and stage empty); `path` names the row's path ("system", "local cuda", ...).
std::string ShmTableHeader();
std::string ShmRow(const CellResult& r, const std::string& path, std::ostream& csv);

/// Reads the server timing (queue, h2d, compute, d2h, total, stage) from a ModelInferResponse's
/// parameters.
bool ParseKServeTiming(grpc::ByteBuffer* buffer, int64_t timing[6]);

}  // namespace flashserve::loadgen
