// The local transport (--local_socket): a Unix stream socket at a path, one thread per
// connection (at most --local_max_connections), each serving request frames one at a time
// (edge/local/local_connection.h). For clients on the server's host: no HTTP/2, no
// completion-queue hops between the socket and the runtime. Who may connect is decided by the
// socket file's permissions (--local_socket_mode) and, with a bearer token, a Hello per
// connection (SECURITY.md).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "edge/local/local_calls.h"
#include "edge/local/local_connection.h"
#include "edge/local/local_options.h"
#include "metrics/metrics.h"

namespace flashserve {

/// Start, StopAccepting, WaitIdle and Stop from one thread (the server's main thread); the
/// accept and connection threads are its own.
class LocalListener {
 public:
  /// Binds and listens at options.socket_path. A socket file there that nobody listens on (a
  /// crashed server's) is replaced; anything else there -- a live server's socket, a regular
  /// file, a directory -- is refused (FAILED_PRECONDITION, naming it). INVALID_ARGUMENT for a
  /// path too long for a Unix socket.
  static absl::StatusOr<std::unique_ptr<LocalListener>> Start(const LocalOptions& options,
                                                              const LocalServices& services);
  /// Stop(false) if not yet stopped.
  ~LocalListener();
  LocalListener(const LocalListener&) = delete;
  LocalListener& operator=(const LocalListener&) = delete;

  /// Stops accepting connections and removes the socket file; open connections go on.
  void StopAccepting();
  /// Waits until no call is between its header and its answer; false if `deadline` came first.
  bool WaitIdle(absl::Time deadline);
  /// StopAccepting, then shuts every connection down and waits for their threads. `drained`:
  /// a call still in progress writes its answer; else its writes are cut off too.
  void Stop(bool drained);

  const std::string& path() const { return options_.socket_path; }

 private:
  LocalListener(const LocalOptions& options, const LocalServices& services);
  void AcceptLoop();
  void Serve(int fd);         // a connection's thread
  void RefuseOverCap(int fd);  // answers RESOURCE_EXHAUSTED and closes

  const LocalOptions options_;
  const LocalServices services_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;     // eventfd: tells the accept loop to stop
  ino_t socket_inode_ = 0;  // the file we bound, so that we unlink only ours
  std::thread accept_thread_;
  LocalCallCount calls_;
  metrics::Gauge* open_gauge_ = nullptr;  // flashserve_local_connections
  std::mutex mu_;
  std::condition_variable closed_cv_;
  std::map<int, bool> open_;  // fd -> shut down by Stop; guarded by mu_
  bool stopped_ = false;      // guarded by mu_
};

}  // namespace flashserve
