#include "edge/http/json_text.h"

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace flashserve::kserve {
namespace {

using nlohmann::json;

// Why the parse stopped, for the client: nlohmann's reason without its "[json.exception...] " tag,
// after " at byte N" unless it names its line and column; clipped, as it quotes the client's text.
// A number such as 1e400 is JSON text that no double holds: "number overflow parsing '1e400'".
std::string DescribeParseError(std::size_t position, const std::string& what) {
  constexpr size_t kShown = 160;
  const size_t tag_end = what.rfind("] ", what.find(' '));
  std::string reason = tag_end == std::string::npos ? what : what.substr(tag_end + 2);
  if (reason.size() > kShown) reason = reason.substr(0, kShown) + "...";
  // Syntax errors name their line and column already.
  if (absl::StartsWith(reason, "parse error at ")) return absl::StrCat(": ", reason);
  return absl::StrCat(" at byte ", position, ": ", reason);
}

// nlohmann's DOM builder, fed by its SAX parser, with each open object's keys tracked. (Its
// callback parser, used until session 42, rescans the parent container at every object's end:
// 600 KB of `[{},{},...]` took 5 s on a listener thread.)
class UniqueKeysDom {
 public:
  explicit UniqueKeysDom(json* out) : dom_(*out, /*allow_exceptions=*/false) {}

  const std::optional<std::string>& duplicate() const { return duplicate_; }
  const std::string& error() const { return error_; }

  bool null() { return dom_.null(); }
  bool boolean(bool value) { return dom_.boolean(value); }
  bool number_integer(json::number_integer_t value) { return dom_.number_integer(value); }
  bool number_unsigned(json::number_unsigned_t value) { return dom_.number_unsigned(value); }
  bool number_float(json::number_float_t value, const std::string& text) {
    return dom_.number_float(value, text);
  }
  bool string(std::string& value) { return dom_.string(value); }
  bool binary(json::binary_t& value) { return dom_.binary(value); }
  bool start_object(std::size_t size) {
    open_.emplace_back();
    return dom_.start_object(size);
  }
  bool key(std::string& key) {
    if (!duplicate_ && !open_.back().insert(key).second) duplicate_ = key;
    return dom_.key(key);
  }
  bool end_object() {
    open_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t size) { return dom_.start_array(size); }
  bool end_array() { return dom_.end_array(); }
  bool parse_error(std::size_t position, const std::string& token,
                   const nlohmann::detail::exception& error) {
    error_ = DescribeParseError(position, error.what());
    return dom_.parse_error(position, token, error);
  }

 private:
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::vector<std::set<std::string>> open_;  // keys of each object being parsed, innermost last
  std::optional<std::string> duplicate_;
  std::string error_;  // where and why the parse stopped, for the client
};

}  // namespace

absl::Status ParseJsonUniqueKeys(absl::string_view text, json* out) {
  // nlohmann's lexer takes a NUL for the end of the input, so a body with junk after one parsed
  // as its first part (what a proxy in front reads may differ).
  if (const size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    *out = json(json::value_t::discarded);
    return absl::InvalidArgumentError(absl::StrCat(
        "request body: not valid JSON at byte ", nul + 1,
        ": a NUL byte (JSON text holds none; a string writes it \\u0000)"));
  }
  UniqueKeysDom sax(out);
  if (!json::sax_parse(text.begin(), text.end(), &sax, json::input_format_t::json,
                       /*strict=*/true)) {
    *out = json(json::value_t::discarded);
    return absl::InvalidArgumentError(absl::StrCat("request body: not valid JSON", sax.error()));
  }
  if (sax.duplicate()) {
    // Clipped: the key is the client's, up to the whole body long.
    constexpr size_t kShown = 64;
    const std::string& key = *sax.duplicate();
    const std::string shown = key.size() > kShown ? key.substr(0, kShown) + "..." : key;
    return absl::InvalidArgumentError(
        absl::StrCat("request body: duplicate key \"", shown, "\" in a JSON object"));
  }
  return absl::OkStatus();
}

absl::Status ScanJson(absl::string_view text, int64_t max_values) {
  int depth = 0;
  int64_t separators = 0;  // commas: a bound on the values, without parsing
  int64_t objects = 0, strings = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        if (++strings > kMaxJsonStrings) {
          return absl::InvalidArgumentError(
              absl::StrCat("request body: more than ", kMaxJsonStrings, " JSON strings"));
        }
        break;
      case '{':
        if (++objects > kMaxJsonObjects) {
          return absl::InvalidArgumentError(
              absl::StrCat("request body: more than ", kMaxJsonObjects, " JSON objects"));
        }
        [[fallthrough]];
      case '[':
        if (++depth > kMaxJsonDepth) {
          return absl::InvalidArgumentError(
              absl::StrCat("request body: JSON nested deeper than ", kMaxJsonDepth, " levels"));
        }
        break;
      case ']':
      case '}':
        --depth;
        break;
      case ',':
        if (++separators > max_values) {
          return absl::ResourceExhaustedError(
              absl::StrCat("request body: more than ", max_values,
                           " JSON values (three tensors of --max_tensor_elements and the rest)"));
        }
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace flashserve::kserve
