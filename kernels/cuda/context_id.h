// Which CUDA context is current, as a number: caches of per-context state (a kernel's raised
// shared-memory limit) must notice a cudaDeviceReset, which replaces the device's context.
#pragma once

namespace flashserve::kernels::cuda {

/// The calling thread's current context's id (cuCtxGetId: unique for the process's life), or 0
/// when there is none yet or it cannot be read.
unsigned long long current_context_id();

}  // namespace flashserve::kernels::cuda
