#include "config/server_config.h"

#include <algorithm>
#include <climits>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace flashserve {
namespace {

absl::Status OutOfRange(absl::string_view flag, int64_t value, int64_t low, int64_t high) {
  return absl::InvalidArgumentError(
      absl::StrCat("--", flag, " must be in [", low, ", ", high, "], got ", value));
}

absl::Status CheckPort(absl::string_view flag, int port) {
  return port >= 0 && port <= 65535 ? absl::OkStatus() : OutOfRange(flag, port, 0, 65535);
}

bool IsModelNameByte(char c) { return absl::ascii_isalnum(c) || c == '_' || c == '-' || c == '.'; }

}  // namespace

absl::Status NetworkOptions::Check() const {
  if (absl::Status s = CheckPort("grpc_port", grpc_port); !s.ok()) return s;
  if (absl::Status s = CheckPort("http_port", http_port); !s.ok()) return s;
  if (absl::Status s = CheckPort("metrics_port", metrics_port); !s.ok()) return s;
  // One port for two listeners fails later as a bare "cannot listen"; name both flags here.
  if (http_port != 0 && http_port == grpc_port) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_port and --grpc_port must differ, both are ", http_port));
  }
  if (metrics_port != 0 && (metrics_port == grpc_port || metrics_port == http_port)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_port must differ from --grpc_port and --http_port, got ", metrics_port));
  }
  if (tls_cert_file.empty() != tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  if (answer_timeout_s < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--answer_timeout_s must be >= 0 (0: no limit), got ", answer_timeout_s));
  }
  if (grpc_memory_quota_bytes < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--grpc_memory_quota_bytes must be -1 (auto), 0 (gRPC's default) or a byte count, got ",
        grpc_memory_quota_bytes));
  }
  return absl::OkStatus();
}

absl::Status HttpLimitsOptions::Check() const {
  for (auto [flag, value] : {std::pair{"http_max_connections", int64_t{max_connections}},
                             std::pair{"http_max_receive_bytes", max_receive_bytes}}) {
    if (value < 1) return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be >= 1"));
  }
  if (max_json_bytes < kMinJsonBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http_max_json_bytes must be >= ", kMinJsonBytes, ", got ", max_json_bytes));
  }
  // libmicrohttpd's per-connection pool is this + 16 KiB; near INT_MAX that sum overflowed and
  // every HTTP and metrics request got an empty reply. The listener needs at least 1 KiB.
  if (max_header_bytes < kMinHeaderBytes || max_header_bytes > kMaxHeaderBytes) {
    return OutOfRange("http_max_header_bytes", max_header_bytes, kMinHeaderBytes, kMaxHeaderBytes);
  }
  // At most a day: libmicrohttpd keeps the idle timeout in 32-bit milliseconds, so from 4294968 s
  // on it wrapped to under a second.
  for (auto [flag, value] : {std::pair{"http_idle_timeout_s", idle_timeout_s},
                             std::pair{"http_header_timeout_s", header_timeout_s},
                             std::pair{"http_body_timeout_s", body_timeout_s}}) {
    if (value < 1 || value > kMaxTimeoutSeconds) {
      return OutOfRange(flag, value, 1, kMaxTimeoutSeconds);
    }
  }
  if (max_connections_per_ip < 0) {
    return absl::InvalidArgumentError("--http_max_connections_per_ip must be >= 0");
  }
  if (min_body_bytes_per_s < 0) {
    return absl::InvalidArgumentError("--http_min_body_bytes_per_s must be >= 0");
  }
  return absl::OkStatus();
}

absl::Status MallocOptions::Check() const {
  // glibc caps M_MMAP_THRESHOLD at 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
  if (mmap_threshold_bytes < 0 || mmap_threshold_bytes > (int64_t{32} << 20)) {
    return OutOfRange("malloc_mmap_threshold_bytes", mmap_threshold_bytes, 0, int64_t{32} << 20);
  }
  if (trim_threshold_bytes < 0 || trim_threshold_bytes > (int64_t{1} << 30)) {
    return OutOfRange("malloc_trim_threshold_bytes", trim_threshold_bytes, 0, int64_t{1} << 30);
  }
  if (arena_max < 0 || arena_max > 1024) return OutOfRange("malloc_arena_max", arena_max, 0, 1024);
  return absl::OkStatus();
}

absl::Status MemoryOptions::Check() const {
  if (receive_arena_bytes < kAuto) {
    return absl::InvalidArgumentError(
        absl::StrCat("--receive_arena_bytes must be -1 (default), 0 or a byte count, got ",
                     receive_arena_bytes));
  }
  if (pinned_pool_bytes < 0) return absl::InvalidArgumentError("--pinned_pool_bytes must be >= 0");
  if (shm.max_regions < 0 || shm.max_regions > 1 << 20) {
    return OutOfRange("shm_max_regions", shm.max_regions, 0, 1 << 20);
  }
  if (shm.max_bytes < 0) return absl::InvalidArgumentError("--shm_max_bytes must be >= 0");
  if (shm.key_prefix.size() > 200 ||
      !std::all_of(shm.key_prefix.begin(), shm.key_prefix.end(), [](char c) {
        return absl::ascii_isalnum(c) || c == '_' || c == '.' || c == '-';
      })) {
    return absl::InvalidArgumentError(
        "--shm_key_prefix: at most 200 letters, digits, '_', '.' and '-' (no '/')");
  }
  return malloc.Check();
}

int64_t MemoryOptions::ReceiveArenaBytesFor(const std::string& backend_name) const {
  if (receive_arena_bytes != kAuto) return receive_arena_bytes;
  // On the CPU backend the arena gains nothing (it only serves tests of the mechanism).
  return backend_name == "cuda" ? kCudaReceiveArenaBytes : 0;
}

absl::Status RequestThreadOptions::Check() const {
  if (copy_threads < 0 || copy_threads > 64) return OutOfRange("copy_threads", copy_threads, 0, 64);
  if (hot_lane_spin_us < kAuto || hot_lane_spin_us > 1000000) {
    return OutOfRange("hot_lane_spin_us", hot_lane_spin_us, kAuto, 1000000);
  }
  return absl::OkStatus();
}

int64_t RequestThreadOptions::HotLaneSpinUsFor(const std::string& backend_name,
                                               unsigned cores) const {
  if (hot_lane_spin_us != kAuto) return hot_lane_spin_us;
  // CPU-backend requests take milliseconds, and on 2-3 cores a polling thread costs too much.
  return backend_name == "cuda" && cores >= 4 ? 1000 : 0;
}

absl::Status LimitsOptions::Check() const {
  const int64_t elements = validation.max_tensor_elements;
  if (elements < 1 || elements > kMaxTensorElementsBound) {
    return OutOfRange("max_tensor_elements", elements, 1, kMaxTensorElementsBound);
  }
  if (max_request_bytes < 1 || max_request_bytes > INT_MAX) {
    return OutOfRange("max_request_bytes", max_request_bytes, 1, INT_MAX);
  }
  if (max_inflight_bytes < 0)
    return absl::InvalidArgumentError("--max_inflight_bytes must be >= 0");
  return absl::OkStatus();
}

absl::Status StreamOptions::Check() const {
  if (max_sessions < 1) return absl::InvalidArgumentError("--stream_max_sessions must be >= 1");
  // At most a day: longer ones overflowed the reaper's clock arithmetic (every session dropped).
  constexpr int64_t kDayMs = int64_t{24} * 3600 * 1000;
  if (session_timeout_ms < 1 || session_timeout_ms > kDayMs) {
    return OutOfRange("stream_session_timeout_ms", session_timeout_ms, 1, kDayMs);
  }
  return absl::OkStatus();
}

absl::Status ModelOptions::Check() const {
  const std::string rule =
      absl::StrCat("a model name is 1 to ", kMaxNameBytes, " letters, digits, '_', '-' and '.'");
  if (model_name.empty() || model_name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model_name is ", model_name.size(), " bytes: ", rule));
  }
  // URL-unreserved bytes only (no '~'): nothing a client must percent-encode in the REST path,
  // and nothing that ends a log line or a metric label. The byte is shown as hex, not echoed.
  const auto bad = std::find_if_not(model_name.begin(), model_name.end(), IsModelNameByte);
  if (bad != model_name.end()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--model_name has byte 0x%02x at offset %d: %s", int(uint8_t(*bad)),
                        bad - model_name.begin(), rule));
  }
  // Dot segments: clients and proxies remove them from a URL path (/v2/models/../infer).
  if (model_name == "." || model_name == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("--model_name must not be \"", model_name, "\" (a URL dot segment): ", rule));
  }
  return absl::OkStatus();
}

absl::Status LogOptions::Check() const {
  for (absl::string_view known :
       {"trace", "debug", "info", "warn", "warning", "error", "err", "critical", "off"}) {
    if (level == known) {
      if (format == "text" || format == "json") return absl::OkStatus();
      return absl::InvalidArgumentError(
          absl::StrCat("--log_format must be text or json, got \"", format, "\""));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--log_level must be trace, debug, info, warn, error, critical or off, got \"", level, "\""));
}

absl::Status ShutdownOptions::Check() const {
  // At most a day: near INT_MAX the overrun limit (grace + 20 s) overflowed and the first
  // SIGTERM exited 3 at once, without a drain.
  constexpr int kDaySeconds = 24 * 3600;
  if (grace_seconds < 0 || grace_seconds > kDaySeconds) {
    return OutOfRange("shutdown_grace_seconds", grace_seconds, 0, kDaySeconds);
  }
  return absl::OkStatus();
}

absl::Status ServerConfig::Check() const {
  for (absl::Status s : {network.Check(), http.Check(), local.Check(), memory.Check(), backend.Check(),
                         scheduler.Check(), limits.Check(), request_threads.Check(), stream.Check(),
                         sequences.Check(), model.Check(), log.Check(), shutdown.Check()}) {
    if (!s.ok()) return s;
  }
  // A quota of a few bytes was accepted, the server said ready, and every gRPC call failed with
  // "Buffers full" (kMinGrpcMemoryQuotaHeadroom says why this floor).
  const int64_t quota = network.grpc_memory_quota_bytes;
  const int64_t min_quota = limits.max_request_bytes + kMinGrpcMemoryQuotaHeadroom;
  if (quota > 0 && quota < min_quota) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grpc_memory_quota_bytes must be -1 (auto), 0 (gRPC's default) or at least "
                     "--max_request_bytes + ",
                     kMinGrpcMemoryQuotaHeadroom, " = ", min_quota, ", got ", quota));
  }
  return absl::OkStatus();
}

BackendOptions ServerConfig::ResolvedBackend() const {
  BackendOptions resolved = backend;
  resolved.cuda.pinned_pool_bytes = memory.pinned_pool_bytes;
  resolved.cpu.buffer_pool_bytes = memory.pinned_pool_bytes;
  return resolved;
}

}  // namespace flashserve
