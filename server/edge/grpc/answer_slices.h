// A DecodeStep's answer as gRPC slices: the small fields copied once into one slice, O and LSE
// sent from the AnswerBuffer they were computed into (edge/sequences/answer_buffer.h), which
// stays alive until gRPC has written its last slice.
#pragma once

#include <memory>

#include "edge/sequences/answer_buffer.h"
#include "grpcpp/support/byte_buffer.h"

namespace flashserve {

/// `pieces` were encoded against `buffer` (may be null when no piece is in a buffer).
grpc::ByteBuffer AnswerByteBuffer(const AnswerPieces& pieces, std::shared_ptr<AnswerBuffer> buffer);

}  // namespace flashserve
