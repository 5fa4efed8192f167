// printf into a std::string, for the load generators' table rows and log lines.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

namespace flashserve::loadgen {

inline std::string Fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline std::string Fmt(const char* format, ...) {
  char line[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  return line;
}

}  // namespace flashserve::loadgen
