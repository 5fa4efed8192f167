#include "edge/grpc/answer_slices.h"

#include <string>
#include <utility>
#include <vector>

#include "grpcpp/support/slice.h"

namespace flashserve {
namespace {

// What the slices point into, freed with the last of them.
struct Kept {
  std::string header;
  std::shared_ptr<AnswerBuffer> buffer;
  std::shared_ptr<void> hold;
};

// A slice over [data, data + bytes) that keeps `kept` alive; its sub-slices share its count.
grpc::Slice KeepingSlice(const char* data, size_t bytes, const std::shared_ptr<Kept>& kept) {
  return grpc::Slice(
      const_cast<char*>(data), bytes,
      [](void* keep) { delete static_cast<std::shared_ptr<Kept>*>(keep); },
      new std::shared_ptr<Kept>(kept));
}

}  // namespace

grpc::ByteBuffer AnswerByteBuffer(AnswerPieces pieces, std::shared_ptr<AnswerBuffer> buffer,
                                  std::shared_ptr<void> hold) {
  auto kept =
      std::make_shared<Kept>(Kept{std::move(pieces.header), std::move(buffer), std::move(hold)});
  const grpc::Slice header = KeepingSlice(kept->header.data(), kept->header.size(), kept);
  grpc::Slice data;
  if (kept->buffer != nullptr) {
    data = KeepingSlice(kept->buffer->data(), kept->buffer->size(), kept);
  }
  kept.reset();  // the slices own it now
  std::vector<grpc::Slice> slices;
  slices.reserve(pieces.pieces.size());
  for (const AnswerPieces::Piece& piece : pieces.pieces) {
    const grpc::Slice& from = piece.in_buffer ? data : header;
    slices.push_back(from.sub(piece.offset, piece.offset + piece.bytes));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace flashserve
