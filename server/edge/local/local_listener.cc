#include "edge/local/local_listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "edge/call/edge_call.h"
#include "edge/local/frame_io.h"
#include "edge/local/local_methods.h"
#include "edge/local/socket_file.h"
#include "spdlog/spdlog.h"

namespace flashserve {

LocalListener::LocalListener(const LocalOptions& options, const LocalServices& services)
    : options_(options), services_(services) {
  if (ServerMetrics* metrics = services.runtime->metrics()) {
    open_gauge_ = metrics->registry()
                      .AddGauge("flashserve_local_connections",
                                "Open connections on the local socket (--local_socket)")
                      .Get();
  }
}

absl::StatusOr<std::unique_ptr<LocalListener>> LocalListener::Start(
    const LocalOptions& options, const LocalServices& services) {
  absl::StatusOr<BoundSocket> bound = BindLocalSocket(options.socket_path, options.socket_mode);
  if (!bound.ok()) return bound.status();
  auto listener = std::unique_ptr<LocalListener>(new LocalListener(options, services));
  listener->listen_fd_ = bound->fd;
  listener->socket_inode_ = bound->inode;
  listener->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (listener->wake_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("local socket: eventfd: ", strerror(errno)));
  }
  listener->accept_thread_ = std::thread([l = listener.get()] { l->AcceptLoop(); });
  spdlog::info("local socket: {} (mode {:o}, at most {} connections, spin {} us)",
               options.socket_path, options.socket_mode, options.max_connections, options.spin_us);
  return listener;
}

LocalListener::~LocalListener() { Stop(/*drained=*/false); }

void LocalListener::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;  // StopAccepting
    if (fds[0].revents == 0) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {  // the client gave up already, or out of descriptors for a moment
      if (errno == EMFILE || errno == ENFILE || errno == ENOMEM || errno == ENOBUFS) {
        absl::SleepFor(absl::Milliseconds(10));  // the connection stays queued; no busy loop
      }
      continue;
    }
    // A client that stops reading cannot hold its thread longer than this per answer.
    const int64_t ms = options_.read_timeout_ms;
    timeval send_timeout{time_t(ms / 1000), suseconds_t(ms % 1000 * 1000)};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &send_timeout, sizeof(send_timeout));
    std::unique_lock<std::mutex> lock(mu_);
    if (int(open_.size()) >= options_.max_connections) {
      lock.unlock();
      RefuseOverCap(fd);
      continue;
    }
    open_[fd] = false;
    if (open_gauge_ != nullptr) open_gauge_->Increment();
    try {
      std::thread([this, fd] { Serve(fd); }).detach();
    } catch (const std::system_error& e) {  // out of threads: this one connection is refused
      open_.erase(fd);
      if (open_gauge_ != nullptr) open_gauge_->Decrement();
      close(fd);
      spdlog::warn("local socket: no thread for a connection: {}", e.what());
    }
  }
}

void LocalListener::RefuseOverCap(int fd) {
  const absl::Status refused = absl::ResourceExhaustedError(absl::StrCat(
      "local socket: ", options_.max_connections,
      " connections are open (--local_max_connections); try again later"));
  // A fresh socket's buffer is empty: this does not block.
  WriteErrorFrame(fd, refused).IgnoreError();
  RecordRefusedCall(services_.runtime->metrics(), local_methods::kOtherLabel, refused);  // logs it
  close(fd);
}

void LocalListener::Serve(int fd) {
  if (spdlog::should_log(spdlog::level::debug)) {
    ucred peer{};
    socklen_t size = sizeof(peer);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &size) == 0) {
      spdlog::debug("local socket: connection from pid={} uid={} gid={}", peer.pid, peer.uid,
                    peer.gid);
    }
  }
  ServeLocalConnection(fd, services_, options_, &calls_);
  std::lock_guard<std::mutex> lock(mu_);
  close(fd);  // under mu_: Stop never shuts down a descriptor number reused by another file
  open_.erase(fd);
  if (open_gauge_ != nullptr) open_gauge_->Decrement();
  closed_cv_.notify_all();
}

void LocalListener::StopAccepting() {
  calls_.draining.store(true);
  if (accept_thread_.joinable()) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) spdlog::warn("local socket: eventfd write failed");
    accept_thread_.join();
  }
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    listen_fd_ = -1;
    RemoveLocalSocket(options_.socket_path, socket_inode_);
  }
}

bool LocalListener::WaitIdle(absl::Time deadline) {
  while (calls_.in_progress.load() > 0) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

void LocalListener::Stop(bool drained) {
  StopAccepting();
  std::unique_lock<std::mutex> lock(mu_);
  if (!stopped_) {
    stopped_ = true;
    // Wakes connections waiting for their next frame (their read sees the end); a call still
    // running finishes and, after a drain, its answer is written before the thread notices
    // (without one, writes are cut off too).
    for (auto& [fd, shut] : open_) {
      shutdown(fd, drained ? SHUT_RD : SHUT_RDWR);
      shut = true;
    }
  }
  closed_cv_.wait(lock, [this] { return open_.empty(); });
  if (wake_fd_ >= 0) {
    close(wake_fd_);
    wake_fd_ = -1;
  }
}

}  // namespace flashserve
