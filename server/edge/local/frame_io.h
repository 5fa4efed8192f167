// Reading request frames from and writing response frames to a local connection's socket
// (proto/flashserve/v1/local_frame.h). The header is checked before any payload byte is
// allocated; a frame once started must arrive whole within the read timeout, so a client that
// trickles bytes cannot hold a connection thread; between frames a connection may stay idle.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "flashserve/v1/local_frame.h"

namespace flashserve {

/// Not thread-safe: one per connection, used by its thread.
class FrameReader {
 public:
  /// `idle_spin`: how long ReadHeader polls the socket for the next frame before it blocks (a
  /// thread blocked in recv wakes tens of microseconds after the bytes arrive on a cold core).
  FrameReader(int fd, int64_t max_payload_bytes, absl::Duration timeout,
              absl::Duration idle_spin = absl::ZeroDuration())
      : fd_(fd), max_payload_bytes_(max_payload_bytes), timeout_(timeout), idle_spin_(idle_spin) {}

  enum class Result { kFrame, kClosed, kRefused };
  /// Waits as long as it takes for the next frame's first byte, then reads and checks its header
  /// (within the timeout from that byte). kClosed: the peer closed (or the server shut the socket
  /// down) between frames. kRefused: `*error` says why (bad header, timeout, a peer that left
  /// mid-header); answer it if possible and close. `first_by`: when the frame's first byte must
  /// have come (a connection not yet authenticated: its Hello), else kRefused (DEADLINE_EXCEEDED).
  /// `busy`: incremented as soon as the frame's first byte is in (a drain waits for the frames
  /// that began, not only for those whose whole header came), and `*counted` set; the caller
  /// decrements it once the frame is answered or refused.
  Result ReadHeader(v1::local::FrameHeader* header, absl::Status* error,
                    absl::Time first_by = absl::InfiniteFuture(),
                    std::atomic<int64_t>* busy = nullptr, bool* counted = nullptr);
  /// Reads the payload of the header just read into `dest` (payload_bytes long), within the same
  /// deadline. DEADLINE_EXCEEDED, or UNAVAILABLE when the peer left mid-frame.
  absl::Status ReadPayload(char* dest, size_t bytes);

 private:
  // Reads exactly `bytes` into `dest` by deadline_.
  // `already`: bytes of the same piece read before (named in the timeout's message).
  absl::Status ReadFull(char* dest, size_t bytes, size_t already = 0);
  // The first bytes of the next frame: polls for idle_spin_, then blocks (until `by`). <= 0:
  // closed; kNothingBy: `by` passed first.
  static constexpr ssize_t kNothingBy = -2;
  ssize_t ReadFirst(unsigned char* dest, size_t bytes, absl::Time by);

  const int fd_;
  const int64_t max_payload_bytes_;
  const absl::Duration timeout_;
  const absl::Duration idle_spin_;
  absl::Time deadline_ = absl::InfiniteFuture();
};

/// Writes one response frame: the header (status, payload length) then `pieces` in order, with
/// as few sendmsg calls as the socket allows (no copy of the pieces; no SIGPIPE). A peer that
/// left, one that stops reading past the socket's send timeout, or one that has not taken the
/// whole frame by `deadline` (a peer reading a little at a time restarts the send timeout at
/// every write) gives an error.
absl::Status WriteFrame(int fd, int status_code, const iovec* pieces, int count,
                        absl::Time deadline = absl::InfiniteFuture());
/// An error frame: `status`'s code, its message as the payload.
absl::Status WriteErrorFrame(int fd, const absl::Status& status);

}  // namespace flashserve
