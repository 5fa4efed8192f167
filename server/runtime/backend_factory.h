// Picks and creates the backend named by BackendOptions::kind (auto, cuda or cpu).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "runtime/backend.h"
#include "runtime/backend_options.h"

namespace flashserve {

struct CreatedBackend {
  std::unique_ptr<Backend> backend;
  std::string reason;  // why this backend was chosen, for the startup log
  int scheduler_workers = 1;
};

/// Checks the options (BackendOptions::Check) and creates the backend: for "auto" the CUDA one
/// when a usable GPU exists, else the CPU one.
absl::StatusOr<CreatedBackend> CreateBackend(const BackendOptions& options);

/// Whether this binary was built with the CUDA backend.
bool CudaBackendCompiledIn();

}  // namespace flashserve
