// Optional bearer-token authentication shared by the gRPC and HTTP edges.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flashserve {

/// Thread-safe (immutable after Create).
class BearerAuth {
 public:
  /// Reads the token from `token_file` (surrounding whitespace stripped). Refuses an empty or
  /// short (< 16 characters) token: a guessable token is worse than none because it looks safe.
  static absl::StatusOr<std::unique_ptr<BearerAuth>> FromFile(const std::string& token_file);
  static absl::StatusOr<std::unique_ptr<BearerAuth>> FromToken(std::string token);

  /// True when `authorization` is "Bearer <token>" with the configured token. The comparison
  /// takes the same time wherever the first difference is (no timing oracle on the token).
  bool Allows(absl::string_view authorization) const;

 private:
  explicit BearerAuth(std::string token) : token_(std::move(token)) {}
  const std::string token_;
};

/// Constant-time equality of two byte strings (time depends only on the lengths).
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

}  // namespace flashserve
