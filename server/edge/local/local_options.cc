#include "edge/local/local_options.h"

#include <sys/un.h>

#include <tuple>

#include "absl/strings/str_cat.h"

namespace flashserve {

absl::Status LocalOptions::Check() const {
  if (socket_path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--local_socket must be at most ", sizeof(sockaddr_un{}.sun_path) - 1, " bytes long"));
  }
  if (socket_mode < 0 || socket_mode > 0777) {
    return absl::InvalidArgumentError("--local_socket_mode must be permission bits in [0, 0777]");
  }
  // payload_bytes is a uint32; protobuf parses at most 2 GiB - 1.
  constexpr int64_t kMaxFrame = (int64_t{1} << 31) - 1;
  for (auto [flag, value, low, high] :
       {std::tuple{"local_max_connections", int64_t{max_connections}, int64_t{1}, int64_t{65536}},
        std::tuple{"local_max_frame_bytes", max_frame_bytes, int64_t{16}, kMaxFrame},
        std::tuple{"local_read_timeout_ms", read_timeout_ms, int64_t{1}, int64_t{3600000}},
        std::tuple{"local_spin_us", spin_us, kAuto, int64_t{1000000}}}) {
    if (value < low || value > high) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be in [", low, ", ", high,
                                                     "], got ", value));
    }
  }
  return absl::OkStatus();
}

}  // namespace flashserve
