#include "local_client.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace flashserve::local {
namespace {

using v1::local::DecodeHeader;
using v1::local::EncodeHeader;
using v1::local::FrameHeader;
using v1::local::kHeaderBytes;
using v1::local::kMagic;

constexpr int kUnavailable = 14, kDeadlineExceeded = 4, kInternal = 13;
// Payload bytes read together with the reply's header (one recvmsg for a small reply instead of
// two); a larger payload's rest goes straight into the reply.
constexpr size_t kFirstReadBytes = size_t(64) << 10;

int ErrnoCode() {
  return errno == EAGAIN || errno == EWOULDBLOCK ? kDeadlineExceeded : kUnavailable;
}

void SetTimeouts(int fd, int timeout_ms) {
  timeval tv{};
  tv.tv_sec = timeout_ms / 1000;
  tv.tv_usec = (timeout_ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Reads exactly `bytes` into `out`; false with errno (0 on end of stream) otherwise.
bool ReadFully(int fd, char* out, size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = recv(fd, out, bytes, 0);
    if (n == 0) errno = 0;
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return false;
    }
    out += n;
    bytes -= size_t(n);
  }
  return true;
}

}  // namespace

std::unique_ptr<LocalClient> LocalClient::Connect(const LocalClientOptions& options,
                                                  CallStatus* error) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (options.socket_path.empty() || options.socket_path.size() >= sizeof address.sun_path) {
    *error = {kUnavailable, "socket path '" + options.socket_path + "' is empty or longer than " +
                                std::to_string(sizeof address.sun_path - 1) + " bytes"};
    return nullptr;
  }
  std::memcpy(address.sun_path, options.socket_path.data(), options.socket_path.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    *error = {kUnavailable, "connect " + options.socket_path + ": " + std::strerror(errno)};
    if (fd >= 0) close(fd);
    return nullptr;
  }
  if (options.timeout_ms > 0) SetTimeouts(fd, options.timeout_ms);
  std::unique_ptr<LocalClient> client(new LocalClient(fd, options));
  if (!options.token.empty()) {
    std::string reply;
    CallStatus hello = client->CallBytes(Method::kHello, options.token, &reply);
    if (!hello.ok()) {
      *error = {hello.code, "Hello: " + hello.message};
      return nullptr;
    }
  }
  return client;
}

LocalClient::~LocalClient() {
  if (fd_ >= 0) close(fd_);
}

CallStatus LocalClient::Fail(int code, const std::string& what) {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;  // the stream's position is unknown: no later call may use it
  return {code, what};
}

CallStatus LocalClient::Send(Method method, const void* payload, size_t bytes) {
  if (bytes > UINT32_MAX) return {kInternal, "payload of " + std::to_string(bytes) + " bytes"};
  FrameHeader header;
  header.method_or_status = uint16_t(method);
  header.payload_bytes = uint32_t(bytes);
  unsigned char head[kHeaderBytes];
  EncodeHeader(header, head);
  iovec iov[2] = {{head, kHeaderBytes}, {const_cast<void*>(payload), bytes}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = bytes > 0 ? 2 : 1;
  while (msg.msg_iovlen > 0) {
    const ssize_t n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Fail(ErrnoCode(), std::string("send: ") + std::strerror(errno));
    size_t left = size_t(n);  // a partial write (large payloads): skip what went out
    while (msg.msg_iovlen > 0 && left >= msg.msg_iov->iov_len) {
      left -= msg.msg_iov->iov_len;
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
    if (msg.msg_iovlen > 0) {
      msg.msg_iov->iov_base = static_cast<char*>(msg.msg_iov->iov_base) + left;
      msg.msg_iov->iov_len -= left;
    }
  }
  return {};
}

ssize_t LocalClient::ReceiveFirst(unsigned char* head, char* body, size_t body_bytes) {
  iovec iov[2] = {{head, kHeaderBytes}, {body, body_bytes}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = 2;
  if (options_.spin_us > 0) {
    const auto until =
        std::chrono::steady_clock::now() + std::chrono::microseconds(options_.spin_us);
    do {
      const ssize_t n = recvmsg(fd_, &msg, MSG_DONTWAIT);
      if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return n;
    } while (std::chrono::steady_clock::now() < until);
  }
  for (;;) {  // SO_RCVTIMEO bounds this wait
    const ssize_t n = recvmsg(fd_, &msg, 0);
    if (n >= 0 || errno != EINTR) return n;
  }
}

CallStatus LocalClient::Receive(std::string* reply) {
  if (first_bytes_ == nullptr) first_bytes_.reset(new char[kFirstReadBytes]);
  unsigned char head[kHeaderBytes];
  const ssize_t n = ReceiveFirst(head, first_bytes_.get(), kFirstReadBytes);
  if (n == 0) errno = 0;
  const size_t got = n > 0 ? size_t(n) : 0;
  if (n <= 0 || (got < kHeaderBytes &&
                 !ReadFully(fd_, reinterpret_cast<char*>(head) + got, kHeaderBytes - got))) {
    return Fail(errno == 0 ? kUnavailable : ErrnoCode(),
                errno == 0 ? "the server closed the connection"
                           : std::string("receive: ") + std::strerror(errno));
  }
  const FrameHeader header = DecodeHeader(head);
  if (header.magic != kMagic) return Fail(kInternal, "reply without the frame magic");
  if (header.payload_bytes > options_.max_reply_bytes) {
    return Fail(kInternal, "reply of " + std::to_string(header.payload_bytes) +
                               " bytes is over the client's limit");
  }
  const size_t early = got > kHeaderBytes ? got - kHeaderBytes : 0;  // payload bytes already here
  if (early > header.payload_bytes) return Fail(kInternal, "reply longer than its header says");
  reply->resize(header.payload_bytes);
  std::memcpy(reply->data(), first_bytes_.get(), early);
  if (!ReadFully(fd_, reply->data() + early, reply->size() - early)) {
    return Fail(errno == 0 ? kUnavailable : ErrnoCode(), "reply payload cut short");
  }
  if (header.method_or_status != 0) return {int(header.method_or_status), *reply};
  return {};
}

CallStatus LocalClient::CallBytes(Method method, const void* payload, size_t bytes,
                                  std::string* reply) {
  if (fd_ < 0) return {kUnavailable, "the connection failed earlier"};
  CallStatus sent = Send(method, payload, bytes);
  if (!sent.ok()) return sent;
  return Receive(reply);
}

CallStatus LocalClient::Call(Method method, const google::protobuf::MessageLite& request,
                             google::protobuf::MessageLite* response) {
  if (!request.SerializeToString(&scratch_)) return {kInternal, "request did not serialize"};
  std::string reply;
  CallStatus status = CallBytes(method, scratch_, &reply);
  if (status.ok() && !response->ParseFromString(reply)) {
    return {kInternal, "reply did not parse as " + response->GetTypeName()};
  }
  return status;
}

}  // namespace flashserve::local
