// Where a DecodeStep's request and response messages live: on one protobuf arena per call.
// A 64-item step is ~1,000 submessages, strings and repeated fields; allocated one by one they
// cost about as much as the rest of the server's host work for the step (CPU build, 2-core host
// loaded by builds: parse 49 -> 26 us, building the call and response 35 -> 18 us of thread CPU
// time; quiet host, local socket: handler -> launch 65 -> 52 us median), and freeing them one by
// one again after the answer.
#pragma once

#include <algorithm>
#include <cstddef>

#include "google/protobuf/arena.h"

namespace flashserve {

/// Arena blocks sized from the request's wire size (its messages take a few times that), so a
/// step needs one or two blocks; at most 1 MiB each (a larger request takes more blocks).
inline google::protobuf::ArenaOptions DecodeStepArenaOptions(size_t payload_bytes) {
  google::protobuf::ArenaOptions options;
  options.start_block_size = std::clamp<size_t>(4 * payload_bytes, 4096, size_t{1} << 20);
  options.max_block_size = std::max<size_t>(options.start_block_size, 65536);
  return options;
}

}  // namespace flashserve
