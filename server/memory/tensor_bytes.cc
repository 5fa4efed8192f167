#include "memory/tensor_bytes.h"

#include <utility>

#include "memory/receive_arena.h"

namespace flashserve {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHeap:
      return "heap";
    case MemoryKind::kPageLocked:
      return "page_locked";
    case MemoryKind::kDevice:
      return "device";
  }
  return "unknown";
}

TensorBytes TensorBytes::Contiguous(MemoryKind kind, const void* data, size_t bytes) {
  TensorBytes t;
  t.kind = kind;
  if (bytes > 0) t.pieces.emplace_back(static_cast<const char*>(data), bytes);
  return t;
}

TensorBytes TensorBytes::FromReceiveBuffers(std::vector<std::string_view> pieces) {
  TensorBytes t;
  t.pieces = std::move(pieces);
  const ReceiveArena* arena = ReceiveArena::Installed();
  bool locked = arena != nullptr && arena->page_locked();
  for (size_t i = 0; locked && i < t.pieces.size(); ++i) {
    locked = arena->Contains(t.pieces[i].data(), t.pieces[i].size());
  }
  t.kind = locked ? MemoryKind::kPageLocked : MemoryKind::kHeap;
  return t;
}

int64_t TensorBytes::size() const {
  int64_t total = 0;
  for (std::string_view piece : pieces) total += int64_t(piece.size());
  return total;
}

}  // namespace flashserve
