#include "edge/local/frame_io.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/utf8.h"
#include "edge/local/frame_check.h"

namespace flashserve {

namespace local = v1::local;

namespace {

// Waits until `fd` is readable (`events` POLLIN) or writable (POLLOUT), or `deadline` passes;
// false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      timeout_ms = int(std::min<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 1 << 30));
    }
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, timeout_ms);
    if (n > 0) return true;  // ready, or hung up / errored: the read or write says which
    if (n < 0 && errno != EINTR) return true;
  }
}

bool WaitReadable(int fd, absl::Time deadline) { return WaitFor(fd, POLLIN, deadline); }
bool WaitWritable(int fd, absl::Time deadline) { return WaitFor(fd, POLLOUT, deadline); }

}  // namespace

absl::Status FrameReader::ReadFull(char* dest, size_t bytes, size_t already) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = recv(fd_, dest + done, bytes - done, MSG_DONTWAIT);
    if (n > 0) {
      done += size_t(n);
      continue;
    }
    if (n == 0) return absl::UnavailableError("local frame: the client left mid-frame");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return absl::UnavailableError(absl::StrCat("local frame: read failed: ", strerror(errno)));
    }
    if (!WaitReadable(fd_, deadline_)) {
      return absl::DeadlineExceededError(
          absl::StrCat("local frame: not complete within ", absl::FormatDuration(timeout_),
                       " (--local_read_timeout_ms); ", already + done, " of ", already + bytes,
                       " bytes arrived"));
    }
  }
  return absl::OkStatus();
}

ssize_t FrameReader::ReadFirst(unsigned char* dest, size_t bytes, absl::Time by) {
  if (idle_spin_ > absl::ZeroDuration()) {
    const absl::Time until = absl::Now() + idle_spin_;
    do {
      const ssize_t n = recv(fd_, dest, bytes, MSG_DONTWAIT);
      if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return n;
    } while (absl::Now() < until);
  }
  for (;;) {  // idle between frames: no deadline unless `by` says one
    if (by != absl::InfiniteFuture()) {
      const int64_t left_ms = absl::ToInt64Milliseconds(by - absl::Now());
      pollfd p{fd_, POLLIN, 0};
      const int ready = left_ms > 0 ? poll(&p, 1, int(std::min<int64_t>(left_ms, 1 << 30))) : 0;
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) return kNothingBy;
    }
    const ssize_t n = recv(fd_, dest, bytes, 0);
    if (n >= 0 || errno != EINTR) return n;  // < 0: reset by the peer, or shut down by the server
  }
}

FrameReader::Result FrameReader::ReadHeader(local::FrameHeader* header, absl::Status* error,
                                            absl::Time first_by, std::atomic<int64_t>* busy,
                                            bool* counted) {
  unsigned char bytes[local::kHeaderBytes];
  const ssize_t first = ReadFirst(bytes, sizeof(bytes), first_by);
  if (first == kNothingBy) {
    *error = absl::DeadlineExceededError("local socket: no frame came in time (a Hello first)");
    return Result::kRefused;
  }
  if (first <= 0) return Result::kClosed;
  if (busy != nullptr) {
    busy->fetch_add(1);
    *counted = true;
  }
  deadline_ = absl::Now() + timeout_;
  *error = ReadFull(reinterpret_cast<char*>(bytes) + first, sizeof(bytes) - size_t(first),
                    size_t(first));
  if (!error->ok()) return Result::kRefused;
  *header = local::DecodeHeader(bytes);
  *error = CheckRequestHeader(*header, max_payload_bytes_);
  return error->ok() ? Result::kFrame : Result::kRefused;
}

absl::Status FrameReader::ReadPayload(char* dest, size_t bytes) { return ReadFull(dest, bytes); }

absl::Status WriteFrame(int fd, int status_code, const iovec* pieces, int count,
                        absl::Time deadline) {
  local::FrameHeader header;
  header.method_or_status = uint16_t(status_code);
  uint64_t total = 0;
  for (int i = 0; i < count; ++i) total += pieces[i].iov_len;
  if (total > UINT32_MAX) return absl::InternalError("local frame: response over 4 GiB");
  header.payload_bytes = uint32_t(total);
  unsigned char head[local::kHeaderBytes];
  local::EncodeHeader(header, head);
  std::vector<iovec> iov;
  iov.reserve(size_t(count) + 1);
  iov.push_back({head, sizeof(head)});
  for (int i = 0; i < count; ++i) {
    if (pieces[i].iov_len > 0) iov.push_back(pieces[i]);
  }
  size_t first = 0;  // the first piece not yet sent whole
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, IOV_MAX);
    // With a deadline, writes never block: a blocking sendmsg on a Unix socket waits for room
    // chunk by chunk, each wait with a fresh send timeout, so a peer taking a little at a time
    // kept one call going for as long as it liked.
    const bool bounded = deadline != absl::InfiniteFuture();
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL | (bounded ? MSG_DONTWAIT : 0));
    if (n < 0 && bounded && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!WaitWritable(fd, deadline)) {
        return absl::DeadlineExceededError(
            "local frame: the peer did not take the answer in time (--local_read_timeout_ms)");
      }
      continue;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat("local frame: write failed: ", strerror(errno)));
    }
    while (n > 0) {  // skip what went out
      iovec& piece = iov[first];
      const size_t step = std::min(size_t(n), piece.iov_len);
      piece.iov_base = static_cast<char*>(piece.iov_base) + step;
      piece.iov_len -= step;
      n -= ssize_t(step);
      if (piece.iov_len == 0) ++first;
    }
  }
  return absl::OkStatus();
}

absl::Status WriteErrorFrame(int fd, const absl::Status& status) {
  std::string message =
      CutErrorMessage(std::string_view(status.message().data(), status.message().size()));
  const iovec piece{message.data(), message.size()};
  return WriteFrame(fd, int(status.code()), &piece, 1);
}

}  // namespace flashserve
