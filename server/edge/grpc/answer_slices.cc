#include "edge/grpc/answer_slices.h"

#include <vector>

#include "grpcpp/support/slice.h"

namespace flashserve {

grpc::ByteBuffer AnswerByteBuffer(const AnswerPieces& pieces,
                                  std::shared_ptr<AnswerBuffer> buffer) {
  const grpc::Slice header(pieces.header);
  grpc::Slice data;  // the whole buffer; its pieces are sub-slices sharing this slice's count
  if (buffer != nullptr) {
    const AnswerBuffer* bytes = buffer.get();
    data = grpc::Slice(
        const_cast<char*>(bytes->data()), bytes->size(),
        [](void* keep) { delete static_cast<std::shared_ptr<AnswerBuffer>*>(keep); },
        new std::shared_ptr<AnswerBuffer>(std::move(buffer)));
  }
  std::vector<grpc::Slice> slices;
  slices.reserve(pieces.pieces.size());
  for (const AnswerPieces::Piece& piece : pieces.pieces) {
    const grpc::Slice& from = piece.in_buffer ? data : header;
    slices.push_back(from.sub(piece.offset, piece.offset + piece.bytes));
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace flashserve
