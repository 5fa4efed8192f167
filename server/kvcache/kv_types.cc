#include "kvcache/kv_types.h"

namespace flashserve::kvcache {

PageFormat FormatFor(const SequenceShape& shape, int page_tokens) {
  PageFormat format;
  format.page_tokens = page_tokens;
  format.row_bytes = shape.row_bytes();
  const int64_t needed = 2 * int64_t(page_tokens) * format.row_bytes;
  int64_t page_bytes = 256;
  while (page_bytes < needed) page_bytes *= 2;
  format.page_bytes = page_bytes;
  format.v_offset = page_bytes / 2;
  return format;
}

}  // namespace flashserve::kvcache
