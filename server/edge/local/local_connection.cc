#include "edge/local/local_connection.h"

#include <poll.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/client_log.h"
#include "common/logging.h"
#include "edge/call/edge_call.h"
#include "edge/local/frame_check.h"
#include "edge/local/frame_io.h"
#include "edge/local/local_methods.h"

namespace flashserve {

namespace local = v1::local;

namespace {

// Before a valid Hello a connection may send only a Hello, and only this many bytes of it: an
// unauthenticated peer cannot make the server allocate more.
constexpr uint32_t kMaxHelloBytes = 4096;
// A connection keeps a payload buffer up to this size between calls; a larger one is freed once
// the connection is idle (DropLargeBufferWhenIdle).
constexpr size_t kKeptBufferBytes = size_t{1} << 20;
constexpr absl::Duration kIdleBeforeDrop = absl::Seconds(1);

const CallMethod& MethodOf(local::Method method) {
  switch (method) {
    case local::Method::kHello:
      return local_methods::kHello;
    case local::Method::kEcho:
      return local_methods::kEcho;
    case local::Method::kAttention:
      return local_methods::kAttention;
    case local::Method::kDecodeStep:
      return local_methods::kDecodeStep;
    case local::Method::kAttend:
      return local_methods::kAttend;
  }
  return local_methods::kEcho;  // not reached: the header was checked
}

bool Computes(local::Method method) {
  return method == local::Method::kAttention || method == local::Method::kDecodeStep ||
         method == local::Method::kAttend;
}

// Whether the client has closed or reset its end (checked when a queued call starts). A client
// that only shut down its sending side (POLLRDHUP) still reads: its call runs.
bool PeerGone(int fd) {
  pollfd p{fd, 0, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0;
}

class Connection {
 public:
  Connection(int fd, const LocalServices& services, const LocalOptions& options,
             LocalCallCount* calls)
      : fd_(fd),
        services_(services),
        options_(options),
        calls_(calls),
        reader_(fd, options.max_frame_bytes, absl::Milliseconds(options.read_timeout_ms),
                absl::Microseconds(options.spin_us)),
        authed_(options.auth == nullptr),
        opened_(absl::Now()) {}

  void Run() {
    for (;;) {
      local::FrameHeader header;
      absl::Status error;
      // Counted from the frame's first byte: a frame still arriving when the drain checked for
      // calls in progress was cut off by its end ("the client left mid-frame", EOF for the client).
      bool counted = false;
      // Until it has sent the token, a connection holds its slot for one read timeout at most.
      const FrameReader::Result read = reader_.ReadHeader(
          &header, &error,
          authed_ ? absl::InfiniteFuture() : opened_ + absl::Milliseconds(options_.read_timeout_ms),
          &calls_->in_progress, &counted);
      if (read == FrameReader::Result::kClosed) return;  // no byte of a frame: never counted
      if (read == FrameReader::Result::kRefused) {
        RecordRefusedCall(services_.runtime->metrics(), local_methods::kOtherLabel, error);
        WriteErrorFrame(fd_, error).IgnoreError();  // the peer may be gone already
        if (counted) calls_->in_progress.fetch_sub(1);
        return;
      }
      const bool keep_open = ServeOne(header);
      calls_->in_progress.fetch_sub(1);
      if (!keep_open || calls_->draining.load()) return;
      DropLargeBufferWhenIdle();
    }
  }

 private:
  // One call, from its checked header to its answer; false: close the connection.
  bool ServeOne(const local::FrameHeader& header) {
    const auto method = static_cast<local::Method>(header.method_or_status);
    EdgeCall metrics(services_.runtime->metrics(), MethodOf(method));
    if (!authed_ && (method != local::Method::kHello || header.payload_bytes > kMaxHelloBytes)) {
      // Refused before the payload is read (or allocated); the connection closes.
      const absl::Status refused =
          method == local::Method::kHello
              ? absl::UnauthenticatedError(absl::StrCat("local socket: a Hello holds at most ",
                                                        kMaxHelloBytes, " bytes (the token), got ",
                                                        header.payload_bytes))
              : absl::UnauthenticatedError(
                    "local socket: send a Hello with the server's bearer token first");
      metrics.Finish(refused);
      WriteErrorFrame(fd_, refused).IgnoreError();
      return false;
    }
    AttentionRuntime::Admission admission;
    if (Computes(method)) admission = services_.runtime->Admit();  // the drain waits from here
    if (absl::Status s = ReadPayload(header.payload_bytes); !s.ok()) {
      metrics.Finish(s);
      WriteErrorFrame(fd_, s).IgnoreError();
      return false;
    }
    metrics.Start(int64_t{local::kHeaderBytes} + header.payload_bytes);
    const std::string_view payload(buffer_.get(), header.payload_bytes);
    LocalReply reply;
    bool keep_open = true;
    if (method == local::Method::kHello) {
      keep_open = Hello(payload, &reply);
    } else if (method == local::Method::kEcho) {
      reply.AddPiece(payload);
    } else if (Computes(method) && !admission) {
      reply.status = absl::UnavailableError("server is shutting down");
    } else {
      Compute(method, payload, std::move(admission), metrics.started(), &reply);
    }
    return Answer(&metrics, &reply) && keep_open;
  }

  // A payload buffer over kKeptBufferBytes stays while calls keep coming (a client sending large
  // requests reuses it: no page faults per call) and goes once the connection has been idle for
  // kIdleBeforeDrop: idle connections held their largest request's buffer (60 of 8 MiB: +0.5 GB).
  void DropLargeBufferWhenIdle() {
    if (buffer_capacity_ <= kKeptBufferBytes) return;
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, int(absl::ToInt64Milliseconds(kIdleBeforeDrop))) == 0) {
      buffer_.reset();
      buffer_capacity_ = 0;
    }
  }

  // The payload into buffer_, allocated only now that the header was checked.
  absl::Status ReadPayload(uint32_t bytes) {
    if (buffer_capacity_ < bytes || buffer_capacity_ > std::max<size_t>(bytes, kKeptBufferBytes)) {
      buffer_.reset(new char[std::max<size_t>(bytes, 1)]);
      buffer_capacity_ = std::max<size_t>(bytes, 1);
    }
    return reader_.ReadPayload(buffer_.get(), bytes);
  }

  // A wrong token closes the connection: one guess per connection.
  bool Hello(std::string_view token, LocalReply* reply) {
    const std::string header =
        absl::StrCat("Bearer ", absl::string_view(token.data(), token.size()));
    if (options_.auth == nullptr || options_.auth->Allows(header)) {
      authed_ = true;
      return true;
    }
    reply->status = absl::UnauthenticatedError("local socket: wrong bearer token");
    return false;
  }

  void Compute(local::Method method, std::string_view payload,
               AttentionRuntime::Admission admission, absl::Time received, LocalReply* reply) {
    LocalCall call;
    call.payload = payload;
    call.admission = std::move(admission);
    call.peer_gone = [fd = fd_] { return PeerGone(fd); };
    call.received = received;
    if (method == local::Method::kAttention) {
      ServeLocalAttention(services_, std::move(call), reply);
    } else if (method == local::Method::kDecodeStep) {
      ServeLocalDecodeStep(services_, std::move(call), reply);
    } else {
      ServeLocalAttend(services_, std::move(call), reply);
    }
  }

  // Records the call and writes its answer; false when the answer could not be written.
  bool Answer(EdgeCall* metrics, LocalReply* reply) {
    int64_t bytes = local::kHeaderBytes;
    for (const iovec& piece : reply->pieces) bytes += int64_t(piece.iov_len);
    metrics->AddBytesOut(bytes);
    metrics->Finish(reply->status);
    // One read timeout for the whole answer: the socket's send timeout alone restarts at every
    // partial write, and a client taking a little at a time held the call (its in-flight bytes,
    // its admission) for as long as it liked.
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.read_timeout_ms);
    const absl::Status written =
        reply->status.ok()
            ? WriteFrame(fd_, 0, reply->pieces.data(), int(reply->pieces.size()), deadline)
            : WriteErrorFrame(fd_, reply->status);
    if (!written.ok() && reply->status.ok()) {
      // Counted OK above (the duration ends where the answer is handed over, as on gRPC), but
      // the client never had it: said here, or the call left no trace.
      WarnFailure(absl::StatusCode::kDeadlineExceeded,
                  "local socket: an answer of {} bytes was not delivered: {}; connection closed",
                  bytes, LogSafe(written.message()));
    }
    return written.ok();
  }

  const int fd_;
  const LocalServices& services_;
  const LocalOptions& options_;
  LocalCallCount* const calls_;
  FrameReader reader_;
  bool authed_;
  const absl::Time opened_;  // a connection without the token must send it within a read timeout
  std::unique_ptr<char[]> buffer_;
  size_t buffer_capacity_ = 0;
};

}  // namespace

void ServeLocalConnection(int fd, const LocalServices& services, const LocalOptions& options,
                          LocalCallCount* calls) {
  Connection(fd, services, options, calls).Run();
}

}  // namespace flashserve
