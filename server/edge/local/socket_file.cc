#include "edge/local/socket_file.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace flashserve {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", strerror(errno)));
}

// Whether some process accepts connections on the socket file at `address`. Non-blocking: a
// listener whose backlog is full (a wedged earlier instance) made a blocking connect wait forever,
// and the server hung before binding anything; EAGAIN says someone listens.
bool SomeoneListens(const sockaddr_un& address) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return true;  // cannot tell: do not replace it
  const bool listens =
      connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 ||
      errno != ECONNREFUSED;
  close(fd);
  return listens;
}

// Clears the way for bind: nothing there, or a stale socket (removed). Anything else is refused.
absl::Status ClearPath(const std::string& path, const sockaddr_un& address) {
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : Errno(absl::StrCat("--local_socket ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--local_socket ", path, " exists and is not a socket: refusing to replace it"));
  }
  if (SomeoneListens(address)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--local_socket ", path, " is in use by another process (a server already listens there)"));
  }
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("--local_socket ", path, ": removing the stale socket"));
  }
  return absl::OkStatus();
}

void UnlinkIfSocket(const std::string& path) {
  struct stat st{};
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) unlink(path.c_str());
}

}  // namespace

absl::StatusOr<ino_t> SetSocketFileMode(const std::string& path, int mode) {
  // O_PATH | O_NOFOLLOW opens the directory entry itself: a symlink put there after bind stays a
  // symlink (chmod(path) would follow it and change the mode of whatever it points at).
  const int fd = open(path.c_str(), O_PATH | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Errno(absl::StrCat("--local_socket ", path, ": open"));
  struct stat st{};
  absl::Status status;
  if (fstat(fd, &st) != 0) {
    status = Errno(absl::StrCat("--local_socket ", path, ": stat"));
  } else if (!S_ISSOCK(st.st_mode)) {
    status = absl::FailedPreconditionError(absl::StrCat(
        "--local_socket ", path, " was replaced by something other than a socket after bind"));
  } else if (chmod(absl::StrCat("/proc/self/fd/", fd).c_str(), mode_t(mode)) != 0) {
    // The inode opened above, whatever the path names now. Without /proc: an error, not a guess.
    status = Errno(absl::StrCat("--local_socket ", path, ": chmod (through /proc/self/fd)"));
  }
  close(fd);
  if (!status.ok()) return status;
  return st.st_ino;
}

absl::StatusOr<BoundSocket> BindLocalSocket(const std::string& path, int mode) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--local_socket must be a path of 1 to ", sizeof(address.sun_path) - 1, " bytes, got ",
        path.size()));
  }
  std::memcpy(address.sun_path, path.data(), path.size());
  if (absl::Status s = ClearPath(path, address); !s.ok()) return s;
  BoundSocket bound;
  bound.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (bound.fd < 0) return Errno("local socket");
  absl::Status status;
  absl::StatusOr<ino_t> inode = ino_t{0};
  if (bind(bound.fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    // No such directory, no permission: the path is the operator's to fix, like a bad flag.
    status = absl::FailedPreconditionError(
        absl::StrCat("--local_socket ", path, ": bind: ", strerror(errno)));
  } else if (inode = SetSocketFileMode(path, mode); !inode.ok()) {
    status = inode.status();
    UnlinkIfSocket(path);  // not what replaced it
  } else if (listen(bound.fd, 128) != 0) {
    status = Errno(absl::StrCat("--local_socket ", path, ": listen"));
    RemoveLocalSocket(path, *inode);
  }
  if (!status.ok()) {
    close(bound.fd);
    return status;
  }
  bound.inode = *inode;
  return bound;
}

void RemoveLocalSocket(const std::string& path, ino_t inode) {
  struct stat st{};
  if (lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == inode) {
    unlink(path.c_str());
  }
}

}  // namespace flashserve
