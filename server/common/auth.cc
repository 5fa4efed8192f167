#include "common/auth.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/flag_file.h"

namespace flashserve {

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Walk the longer length in full so the time does not reveal where the strings differ.
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  // Keep the compiler from turning the loop into an early-exit comparison.
  volatile unsigned char result = diff;
  return result == 0;
}

absl::StatusOr<std::unique_ptr<BearerAuth>> BearerAuth::FromToken(std::string token) {
  token = std::string(absl::StripAsciiWhitespace(token));
  if (token.size() < 16) {
    return absl::InvalidArgumentError("auth token must be at least 16 characters");
  }
  for (char c : token) {
    if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e) {
      return absl::InvalidArgumentError("auth token must be printable ASCII without spaces");
    }
  }
  return std::unique_ptr<BearerAuth>(new BearerAuth(std::move(token)));
}

absl::StatusOr<std::unique_ptr<BearerAuth>> BearerAuth::FromFile(const std::string& token_file) {
  absl::StatusOr<std::string> text =
      ReadFlagFile(token_file, "--auth_token_file", kMaxTokenFileBytes);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::unique_ptr<BearerAuth>> auth = FromToken(*text);
  if (!auth.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--auth_token_file: ", auth.status().message()));
  }
  return auth;
}

bool BearerAuth::Allows(absl::string_view authorization) const {
  constexpr absl::string_view kScheme = "Bearer ";
  if (authorization.size() < kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme)) {
    return false;
  }
  return ConstantTimeEquals(authorization.substr(kScheme.size()), token_);
}

}  // namespace flashserve
