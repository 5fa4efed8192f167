// Cutting client-supplied text to a length without splitting a UTF-8 character: the pieces travel
// on in proto3 strings and gRPC status messages, which clients decode as UTF-8.
#pragma once

#include <cstddef>
#include <string_view>

namespace flashserve {

/// The longest prefix of `text` of at most `max_bytes` that ends on a character boundary.
inline std::string_view Utf8Prefix(std::string_view text, size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  size_t n = max_bytes;
  while (n > 0 && (static_cast<unsigned char>(text[n]) & 0xC0) == 0x80) --n;  // continuation byte
  return text.substr(0, n);
}

}  // namespace flashserve
