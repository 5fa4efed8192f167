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
  int64_t spin_us = 100;              // polls for done() and for the next frame this long, then sleeps
  const BearerAuth* auth = nullptr;   // set: every call needs a Hello with the token first

  /// INVALID_ARGUMENT naming the flag of the first value out of range.
  absl::Status Check() const;
};

}  // namespace flashserve
