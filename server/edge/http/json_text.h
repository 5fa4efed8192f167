// JSON text from REST clients, before and while it becomes a DOM: a linear scan that bounds what
// the DOM would hold, and a parse that refuses duplicate keys. Both run on the HTTP listener's
// threads, so both must stay linear in the text (kserve_json.h, shm_rest.cc use them).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace flashserve::kserve {

/// Largest nesting of a REST JSON header (objects and arrays together).
inline constexpr int kMaxJsonDepth = 40;
/// Objects and strings (keys included) in one REST JSON text: a KServe infer header holds a few
/// dozen of each; each costs the DOM ~64-80 bytes for 2-3 bytes of text, against 16 for a number.
inline constexpr int64_t kMaxJsonObjects = 4096;
inline constexpr int64_t kMaxJsonStrings = 65536;

/// A linear pass over JSON text before it is parsed: INVALID_ARGUMENT if it nests deeper than
/// kMaxJsonDepth or holds more than kMaxJsonObjects objects or kMaxJsonStrings strings,
/// RESOURCE_EXHAUSTED naming --max_tensor_elements if it holds more than `max_values` values (the
/// DOM would be built for nothing). Strings are skipped correctly.
absl::Status ScanJson(absl::string_view json, int64_t max_values);

/// Parses a REST body's JSON into `out` in one linear pass; INVALID_ARGUMENT when it is not
/// valid JSON (`out` is then discarded) or an object holds one key twice (naming the key; `out`
/// holds the parsed DOM). nlohmann would keep the last value while a proxy or WAF in front may
/// judge the first: the two must not see different requests.
absl::Status ParseJsonUniqueKeys(absl::string_view text, nlohmann::json* out);

}  // namespace flashserve::kserve
