// Bearer-token check for gRPC handlers (metadata "authorization: Bearer <token>").
#pragma once

#include <string>

#include "common/auth.h"
#include "grpcpp/server_context.h"

namespace flashserve {

/// True when no token is configured or the call carries the right one. Handlers that get false
/// finish the call with UNAUTHENTICATED before reading the request.
inline bool GrpcCallAuthorized(const BearerAuth* auth, const grpc::CallbackServerContext* context) {
  if (auth == nullptr) return true;
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return false;
  return auth->Allows(absl::string_view(it->second.data(), it->second.size()));
}

inline constexpr const char kUnauthenticatedMessage[] = "missing or invalid bearer token";

}  // namespace flashserve
