// A DecodeStep's answer as gRPC slices: the encoded small fields and O / LSE sent from where they
// are (the AnswerBuffer they were computed into, edge/sequences/answer_buffer.h). Everything the
// slices point into, and `hold`, stays alive until gRPC has released the last slice: the answer
// was written, or its call is gone.
#pragma once

#include <memory>

#include "edge/sequences/answer_buffer.h"
#include "grpcpp/support/byte_buffer.h"

namespace flashserve {

/// `pieces` were encoded against `buffer` (may be null when no piece is in a buffer). `hold` (may
/// be null) is released with the slices: e.g. the call's admission, so that a drain waits for the
/// answer to be written.
grpc::ByteBuffer AnswerByteBuffer(AnswerPieces pieces, std::shared_ptr<AnswerBuffer> buffer,
                                  std::shared_ptr<void> hold);

}  // namespace flashserve
