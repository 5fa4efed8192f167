#include "edge/http/shm_rest.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "edge/http/kserve_json.h"
#include "nlohmann/json.hpp"
#include "runtime/shm_requests.h"

namespace flashserve {
namespace {

using nlohmann::json;

constexpr int64_t kMaxBodyBytes = 64 << 10;  // a register call is a few hundred bytes

// A register / unregister body: collected (bounded by the route), then handled at once.
class JsonUpload : public HttpUpload {
 public:
  using Handler = std::function<HttpAnswer(const std::string& body)>;
  explicit JsonUpload(Handler handler) : handler_(std::move(handler)) {}
  absl::Status OnBody(absl::string_view piece) override {
    body_.append(piece.data(), piece.size());
    return absl::OkStatus();
  }
  void OnComplete(HttpReply reply, HttpPeerGone) override { reply(handler_(body_)); }

 private:
  Handler handler_;
  std::string body_;
};

absl::StatusOr<json> ParseObject(const std::string& body) {
  if (body.empty()) return json::object();
  json parsed;
  const absl::Status status = kserve::ParseJsonUniqueKeys(body, &parsed);
  if (parsed.is_discarded() || !parsed.is_object()) {
    return absl::InvalidArgumentError("request body: must be a JSON object");
  }
  RETURN_IF_ERROR(status);  // a key given twice (two "offset"s)
  return parsed;
}

// A field that must be a non-negative integer (absent: `fallback`, or an error when < 0).
absl::StatusOr<uint64_t> Unsigned(const json& body, const char* key, int64_t fallback) {
  auto it = body.find(key);
  if (it == body.end()) {
    if (fallback < 0) return absl::InvalidArgumentError(absl::StrCat(key, ": missing"));
    return uint64_t(fallback);
  }
  if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": must be an integer >= 0"));
  }
  return it->get<uint64_t>();
}

HttpAnswer RegisterSystem(AttentionRuntime* runtime, const std::string& name,
                          const std::string& body) {
  ASSIGN_OR_RETURN(json request, ParseObject(body));
  auto key = request.find("key");
  if (key == request.end()) {
    return absl::InvalidArgumentError("key: missing (the shared-memory object's key)");
  }
  if (!key->is_string()) return absl::InvalidArgumentError("key: must be a string");
  ASSIGN_OR_RETURN(uint64_t offset, Unsigned(request, "offset", 0));
  ASSIGN_OR_RETURN(uint64_t byte_size, Unsigned(request, "byte_size", -1));
  RETURN_IF_ERROR(RegisterSystemShm(*runtime, name, key->get<std::string>(), offset, byte_size, ""));
  return HttpResponse::Json(200, "{}");
}

HttpAnswer RegisterCuda(AttentionRuntime* runtime, const std::string& name,
                        const std::string& body) {
  ASSIGN_OR_RETURN(json request, ParseObject(body));
  auto handle = request.find("raw_handle");
  if (handle == request.end() || !handle->is_object() || !handle->contains("b64") ||
      !(*handle)["b64"].is_string()) {
    return absl::InvalidArgumentError("raw_handle.b64: missing (a base64 cudaIpcMemHandle)");
  }
  std::string raw;
  if (!absl::Base64Unescape((*handle)["b64"].get<std::string>(), &raw)) {
    return absl::InvalidArgumentError("raw_handle.b64: not base64");
  }
  auto device = request.find("device_id");
  if (device == request.end() || !device->is_number_integer()) {
    return absl::InvalidArgumentError("device_id: must be an integer");
  }
  if (device->is_number_unsigned() && device->get<uint64_t>() > INT64_MAX) {
    // Named as sent (an int64 would show it clamped to INT64_MAX).
    return absl::InvalidArgumentError(
        absl::StrCat("device_id: ", device->get<uint64_t>(), " is not a device"));
  }
  const int64_t device_id = device->get<int64_t>();
  ASSIGN_OR_RETURN(uint64_t byte_size, Unsigned(request, "byte_size", -1));
  RETURN_IF_ERROR(RegisterCudaShm(*runtime, name, raw, device_id, byte_size, ""));
  return HttpResponse::Json(200, "{}");
}

HttpAnswer StatusJson(AttentionRuntime* runtime, ShmType type, const std::string& name) {
  ASSIGN_OR_RETURN(std::vector<ShmRegionInfo> regions, ShmStatus(*runtime, type, name, ""));
  json out = json::array();
  for (const ShmRegionInfo& r : regions) {
    if (type == ShmType::kSystem) {
      out.push_back(
          {{"name", r.name}, {"key", r.key}, {"offset", r.offset}, {"byte_size", r.byte_size}});
    } else {
      out.push_back({{"name", r.name}, {"device_id", r.device}, {"byte_size", r.byte_size}});
    }
  }
  return HttpResponse::Json(200, out.dump());
}

HttpRoute Post(std::string pattern, std::string metric,
               std::function<HttpAnswer(const std::string& name, const std::string& body)> fn) {
  HttpRoute route;
  route.method = "POST";
  route.pattern = std::move(pattern);
  route.metric = std::move(metric);
  route.max_body_bytes = kMaxBodyBytes;
  route.body_limit_flag = "64 KiB (a shared-memory call's body)";
  route.post = [fn = std::move(fn)](const HttpRequest& req)
      -> absl::StatusOr<std::unique_ptr<HttpUpload>> {
    const std::string name = req.match(1);
    return std::unique_ptr<HttpUpload>(
        new JsonUpload([fn, name](const std::string& body) { return fn(name, body); }));
  };
  return route;
}

void AddRoutes(AttentionRuntime* runtime, ShmType type, std::vector<HttpRoute>* routes) {
  const bool system = type == ShmType::kSystem;
  const std::string base = system ? "/v2/systemsharedmemory" : "/v2/cudasharedmemory";
  const std::string prefix = system ? "SystemSharedMemory" : "CudaSharedMemory";
  const std::string region = "(?:/region/([^/]+))?";
  HttpRoute status;
  status.pattern = base + region + "/status";
  status.metric = prefix + "Status";
  status.get = [runtime, type](const HttpRequest& req) {
    return StatusJson(runtime, type, req.match(1));
  };
  routes->push_back(std::move(status));
  routes->push_back(Post(base + "/region/([^/]+)/register", prefix + "Register",
                         [runtime, system](const std::string& name, const std::string& body) {
                           return system ? RegisterSystem(runtime, name, body)
                                         : RegisterCuda(runtime, name, body);
                         }));
  routes->push_back(Post(base + region + "/unregister", prefix + "Unregister",
                         [runtime, type](const std::string& name, const std::string&) -> HttpAnswer {
                           RETURN_IF_ERROR(UnregisterShm(*runtime, type, name, ""));
                           return HttpResponse::Json(200, "{}");
                         }));
}

}  // namespace

std::vector<HttpRoute> ShmRestRoutes(AttentionRuntime* runtime) {
  std::vector<HttpRoute> routes;
  AddRoutes(runtime, ShmType::kSystem, &routes);
  AddRoutes(runtime, ShmType::kCuda, &routes);
  return routes;
}

}  // namespace flashserve
