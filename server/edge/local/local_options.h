// The local transport's settings (--local_* flags; README "Server flags").
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace flashserve {

class BearerAuth;

struct LocalOptions {
  std::string socket_path;            // empty: no local socket
  int socket_mode = 0600;             // the socket file's permission bits: who may connect
  int max_connections = 64;           // open connections at once; beyond: an error frame, closed
  int64_t max_frame_bytes = int64_t{8} << 20;  // payload bytes of one request frame
  int64_t read_timeout_ms = 10000;    // a started frame must arrive whole within this long
  static constexpr int64_t kAuto = -1;
  // Polls for done() and for the next frame this long (us), then sleeps. kAuto: SpinUsFor.
  int64_t spin_us = kAuto;
  const BearerAuth* auth = nullptr;   // set: every call needs a Hello with the token first

  /// spin_us with kAuto resolved: 200 on a machine with >= 4 cores (a polling thread then does
  /// not take the core the answer is computed or the client runs on), else 0.
  int64_t SpinUsFor(unsigned cores) const {
    return spin_us != kAuto ? spin_us : (cores >= 4 ? 200 : 0);
  }

  /// INVALID_ARGUMENT naming the flag of the first value out of range.
  absl::Status Check() const;
};

}  // namespace flashserve
