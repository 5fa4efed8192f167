// The local transport's socket file: bound with the right permissions, a stale one replaced only
// when it is a socket nobody listens on, and removed at shutdown only if it is still ours.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace flashserve {

struct BoundSocket {
  int fd = -1;      // listening, close-on-exec
  ino_t inode = 0;  // of the socket file
};

/// Binds a Unix stream socket at `path`, sets the file's mode to `mode` before it listens (so no
/// connection is possible under other permissions) and listens. INVALID_ARGUMENT: `path` is too
/// long. FAILED_PRECONDITION: something other than a stale socket is at `path`, or it cannot be
/// bound there (no such directory, no permission). Others: errno.
absl::StatusOr<BoundSocket> BindLocalSocket(const std::string& path, int mode);

/// Sets the mode of the socket file at `path` without following a symlink: FAILED_PRECONDITION when
/// something other than a socket is there now (whoever can write the directory may have swapped the
/// file between bind and chmod). Returns the file's inode.
absl::StatusOr<ino_t> SetSocketFileMode(const std::string& path, int mode);

/// Unlinks `path` if it is still the socket file of `inode` (another process may have replaced it).
void RemoveLocalSocket(const std::string& path, ino_t inode);

}  // namespace flashserve
