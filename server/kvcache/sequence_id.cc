#include "kvcache/sequence_id.h"

#include "common/random_id.h"

namespace flashserve::kvcache {

absl::StatusOr<std::string> NewSequenceId() { return RandomHexId128("sequence id"); }

}  // namespace flashserve::kvcache
