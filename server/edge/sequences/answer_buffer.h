// Where a DecodeStep's O and LSE go when they travel in the answer (not into a client's region):
// one buffer from the backend's staging pool, and the answer sent as pieces that point into it.
//
// Why: written into the response message, each step's O (512 KiB for 64 sequences of a
// Llama-3-8B-like layer) was zero-filled when the message was sized, copied there from the
// store's own staging after the launch, and copied again when the message was serialized. From
// the pool (page-locked on the CUDA backend) the decode launch writes O where it is sent from
// (the store's in-place output path), and the transports send it without a copy: gRPC as slices
// of the buffer, the local socket as iovecs.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "flashserve/v1/sequences.pb.h"
#include "kvcache/kv_types.h"
#include "memory/pinned_pool.h"

namespace flashserve {

class AnswerBuffer {
 public:
  /// Room for `out_bytes` of O then `lse_bytes` of LSE (each part 256-byte aligned) from `pool`
  /// (may be null); nullptr when the pool has none (the outputs then go into the message).
  static std::shared_ptr<AnswerBuffer> Acquire(PinnedPool* pool, size_t out_bytes,
                                               size_t lse_bytes);

  /// The next `bytes` of the O part (or LSE part), back to back in call order, for `tensor` (the
  /// result's tensor, which keeps dtype and shape only); nullptr when the part is full. Taken in
  /// the results' order, each result's O before its LSE, a packed answer's (one O, one LSE)
  /// before any result's (EncodeDecodeStepAnswer relies on it).
  char* TakeOut(size_t bytes, const v1::Tensor* tensor) { return Take(&out_, bytes, tensor); }
  char* TakeLse(size_t bytes, const v1::Tensor* tensor) { return Take(&lse_, bytes, tensor); }
  kvcache::BytesAt at() const { return at_; }

  /// A tensor whose data is in this buffer: `bytes` at data().
  struct Span {
    const v1::Tensor* tensor;
    const char* data;
    size_t bytes;
  };
  const std::vector<Span>& spans() const { return spans_; }
  const char* data() const { return buffer_.data(); }
  size_t size() const { return buffer_.capacity(); }

 private:
  struct Part {
    size_t next = 0, end = 0;
  };
  AnswerBuffer(PinnedPool::Buffer buffer, kvcache::BytesAt at)
      : buffer_(std::move(buffer)), at_(at) {}
  char* Take(Part* part, size_t bytes, const v1::Tensor* tensor);

  PinnedPool::Buffer buffer_;
  const kvcache::BytesAt at_;
  Part out_, lse_;
  std::vector<Span> spans_;
};

/// A serialized DecodeStepResponse in pieces: `header` bytes, or data of the answer buffer.
struct AnswerPieces {
  struct Piece {
    bool in_buffer = false;  // else in `header`
    size_t offset = 0, bytes = 0;
  };
  std::string header;
  std::vector<Piece> pieces;
  size_t total_bytes = 0;

  /// A piece's bytes, `header` being where the header bytes are now (`buffer`: the AnswerBuffer
  /// the pieces were encoded against).
  static std::string_view View(const Piece& piece, std::string_view header,
                               const AnswerBuffer* buffer) {
    return piece.in_buffer ? std::string_view(buffer->data() + piece.offset, piece.bytes)
                           : header.substr(piece.offset, piece.bytes);
  }
  std::string_view View(const Piece& piece, const AnswerBuffer* buffer) const {
    return View(piece, header, buffer);
  }
};

/// The wire bytes of `response`, whose results' (or packed answer's) tensors listed in `buffer`
/// (may be null) take their data from it: parsing the concatenated pieces gives `response` with
/// that data filled in. A packed answer taken from the buffer is written first (the client reads
/// it without walking the results). Consumes the response's results (cleared; the rest of the
/// message stays).
AnswerPieces EncodeDecodeStepAnswer(v1::DecodeStepResponse* response, const AnswerBuffer* buffer);

}  // namespace flashserve
