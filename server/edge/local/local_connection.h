// One accepted local-socket connection: reads request frames one at a time, answers each
// (edge/local/frame_io.h), and ends when the client leaves, a frame is refused, or the server
// shuts the socket down. Runs on its own thread; the listener owns the socket.
#pragma once

#include <atomic>
#include <cstdint>

#include "edge/local/local_calls.h"
#include "edge/local/local_options.h"
#include "metrics/server_metrics.h"

namespace flashserve {

/// Counts calls between their header and their answer, for the drain. Thread-safe.
struct LocalCallCount {
  std::atomic<int64_t> in_progress{0};
  // Set when the listener stops accepting (a drain begins): a connection closes after the answer
  // it is writing, so that clients sending frames back to back cannot keep in_progress above zero
  // (the drain waits for zero) until the grace period ends.
  std::atomic<bool> draining{false};
};

/// Serves `fd` until it is done with it (does not close it). Borrowed arguments outlive the call.
void ServeLocalConnection(int fd, const LocalServices& services, const LocalOptions& options,
                          LocalCallCount* calls);

}  // namespace flashserve
