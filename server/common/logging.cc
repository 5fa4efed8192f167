#include "common/logging.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/protobuf_errors.h"
#include "spdlog/formatter.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

void AppendJsonEscaped(std::string_view text, spdlog::memory_buf_t& out) {
  for (char c : text) {
    switch (c) {
      case '"':
        out.append(std::string_view("\\\""));
        break;
      case '\\':
        out.append(std::string_view("\\\\"));
        break;
      case '\n':
        out.append(std::string_view("\\n"));
        break;
      case '\r':
        out.append(std::string_view("\\r"));
        break;
      case '\t':
        out.append(std::string_view("\\t"));
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out.append(std::string_view(buf));
        } else {
          out.push_back(c);
        }
    }
  }
}

// {"time":"2026-11-22T01:02:03.456Z","level":"info","thread":123,"msg":"..."}
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const std::time_t seconds =
        std::chrono::duration_cast<std::chrono::seconds>(since_epoch).count();
    const int millis =
        int(std::chrono::duration_cast<std::chrono::milliseconds>(since_epoch).count() % 1000);
    std::tm utc{};
    gmtime_r(&seconds, &utc);
    char time_buf[96];
    std::snprintf(time_buf, sizeof(time_buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ",
                  utc.tm_year + 1900, utc.tm_mon + 1, utc.tm_mday, utc.tm_hour, utc.tm_min,
                  utc.tm_sec, millis);
    const auto level = spdlog::level::to_string_view(msg.level);
    const std::string head = absl::StrCat(R"({"time":")", time_buf, R"(","level":")",
                                          absl::string_view(level.data(), level.size()),
                                          R"(","thread":)", msg.thread_id, R"(,"msg":")");
    dest.append(std::string_view(head));
    AppendJsonEscaped(std::string_view(msg.payload.data(), msg.payload.size()), dest);
    dest.append(std::string_view("\"}\n"));
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<JsonFormatter>();
  }
};

}  // namespace

std::string LogSafe(absl::string_view text, size_t max_bytes) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_bytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(char(c));
    } else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out.push_back(char(c));
    }
  }
  if (text.size() > max_bytes) absl::StrAppend(&out, "...(", text.size(), " bytes)");
  return out;
}

absl::Status ConfigureLogging(absl::string_view level, absl::string_view format) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_level: unknown level \"", level,
                     "\" (trace, debug, info, warn, error, critical, off)"));
  }
  // Logs go to stderr (stdout stays free for tools that print results).
  spdlog::set_default_logger(spdlog::stderr_color_mt("flashserve"));
  spdlog::set_level(parsed);
  RouteProtobufLogs();
  if (format == "json") {
    spdlog::set_formatter(std::make_unique<JsonFormatter>());
  } else if (format != "text") {
    return absl::InvalidArgumentError(
        absl::StrCat("--log_format: must be text or json, got \"", format, "\""));
  }
  return absl::OkStatus();
}

}  // namespace flashserve
