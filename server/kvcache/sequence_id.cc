#include "kvcache/sequence_id.h"

#include "absl/strings/str_cat.h"
#include "common/random_id.h"

namespace flashserve::kvcache {

absl::StatusOr<std::string> NewSequenceId() { return RandomHexId128("sequence id"); }

bool WellFormedSequenceId(std::string_view id) {
  if (id.size() != 32) return false;
  for (const char c : id) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

std::string ShownSequenceId(std::string_view id) {
  if (WellFormedSequenceId(id)) return std::string(id);
  return absl::StrCat("a malformed id (", id.size(), " bytes)");
}

}  // namespace flashserve::kvcache
