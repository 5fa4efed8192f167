// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status code inside the server.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define FLASHSERVE_CONCAT_INNER(a, b) a##b
#define FLASHSERVE_CONCAT(a, b) FLASHSERVE_CONCAT_INNER(a, b)

#define RETURN_IF_ERROR(expr)          \
  do {                                 \
    ::absl::Status _status = (expr);   \
    if (!_status.ok()) return _status; \
  } while (0)

#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL(FLASHSERVE_CONCAT(_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL(statusor, lhs, expr) \
  auto statusor = (expr);                          \
  if (!statusor.ok()) return statusor.status();    \
  lhs = std::move(statusor).value()
