// Client-supplied text that travels on in proto3 strings, gRPC status messages and JSON, which
// clients decode as UTF-8: cutting it without splitting a character, and telling well-formed
// characters apart.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace flashserve {

/// The longest prefix of `text` of at most `max_bytes` that ends on a character boundary.
inline std::string_view Utf8Prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t n = max_bytes;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;  // continuation byte
  return text.substr(0, n);
}

/// Error messages quote client text (a name, a JSON excerpt): a message past this many bytes is
/// cut before it goes back over HTTP or the local socket (gRPC cuts its own, grpc_status.h), so
/// that a client's megabytes are not copied back to it several times over.
inline constexpr size_t kMaxErrorMessageBytes = 4096;

/// `message` cut to at most kMaxErrorMessageBytes on a character boundary, saying so when cut.
inline std::string CutErrorMessage(std::string_view message) {
  if (message.size() <= kMaxErrorMessageBytes) return std::string(message);
  std::string out(Utf8Prefix(message, kMaxErrorMessageBytes));
  out += "... (cut, " + std::to_string(message.size()) + " bytes)";
  return out;
}

/// The length (2-4) of the well-formed multi-byte UTF-8 character at `text[i]` (RFC 3629: no
/// overlong forms, no surrogates, nothing above U+10FFFF), or 0 when the bytes there are not one.
inline size_t Utf8MultiByteLength(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte; the others are 0x80..0xBF
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;  // overlong
    if (lead == 0xED) hi = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;  // overlong
    if (lead == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  }
  return n;
}

}  // namespace flashserve
