#include "common/flag_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace flashserve {

absl::StatusOr<std::string> ReadFlagFile(const std::string& path, const char* flag,
                                         int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer.
  const int fd = open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const std::string why = absl::StrCat(flag, ": cannot read ", path, ": ", std::strerror(errno));
    return errno == EACCES || errno == EPERM ? absl::PermissionDeniedError(why)
                                             : absl::NotFoundError(why);
  }
  struct stat st {};
  std::string text;
  absl::Status status;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > max_bytes) {
    status = absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " is not a regular file of at most ", max_bytes, " bytes"));
  } else {
    text.resize(size_t(st.st_size));
    size_t got = 0;
    while (got < text.size()) {
      const ssize_t n = read(fd, text.data() + got, text.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // shrank meanwhile: what was there
      got += size_t(n);
    }
    text.resize(got);
  }
  close(fd);
  if (!status.ok()) return status;
  return text;
}

}  // namespace flashserve
