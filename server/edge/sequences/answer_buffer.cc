#include "edge/sequences/answer_buffer.h"

#include <vector>

#include "api/response_wire.h"

namespace flashserve {
namespace {

constexpr size_t kAlign = 256;
constexpr uint32_t kLengthDelimited = 2;
constexpr int kResultsField = 1, kPackedField = 5;  // DecodeStepResponse.results / packed
constexpr int kOutField = 1, kLseField = 2;  // DecodeResult.out / lse, PackedDecodeAnswer.out / lse

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

void AppendTag(int field, std::string* out) {
  AppendVarint(uint64_t(field) << 3 | kLengthDelimited, out);
}

class PieceWriter {
 public:
  explicit PieceWriter(AnswerPieces* out) : out_(out) {}
  void Header(std::string_view bytes) {
    if (bytes.empty()) return;
    const size_t offset = out_->header.size();
    out_->header.append(bytes);
    AnswerPieces::Piece* last = out_->pieces.empty() ? nullptr : &out_->pieces.back();
    if (last != nullptr && !last->in_buffer && last->offset + last->bytes == offset) {
      last->bytes += bytes.size();  // adjacent header bytes: one piece
    } else {
      out_->pieces.push_back({false, offset, bytes.size()});
    }
    out_->total_bytes += bytes.size();
  }
  void Data(const AnswerBuffer::Span& span, const AnswerBuffer& buffer) {
    out_->pieces.push_back({true, size_t(span.data - buffer.data()), span.bytes});
    out_->total_bytes += span.bytes;
  }

 private:
  AnswerPieces* const out_;
};

// Field `field` of the response, a DecodeResult or PackedDecodeAnswer (both: out = 1, lse = 2)
// whose out and/or lse data lie in the buffer.
template <typename Outputs>
void WriteSpliced(int field, const Outputs& result, const AnswerBuffer::Span* out,
                  const AnswerBuffer::Span* lse, const AnswerBuffer& buffer, PieceWriter* writer) {
  const std::string out_prefix = out ? TensorFieldPrefix(kOutField, result.out(), out->bytes) : "";
  const std::string lse_prefix = lse ? TensorFieldPrefix(kLseField, result.lse(), lse->bytes) : "";
  Outputs rest = result;
  if (out != nullptr) rest.clear_out();
  if (lse != nullptr) rest.clear_lse();
  const std::string rest_bytes = rest.SerializeAsString();
  std::string head;
  AppendTag(field, &head);
  AppendVarint(out_prefix.size() + (out ? out->bytes : 0) + lse_prefix.size() +
                   (lse ? lse->bytes : 0) + rest_bytes.size(),
               &head);
  writer->Header(head + out_prefix);
  if (out != nullptr) writer->Data(*out, buffer);
  writer->Header(lse_prefix);
  if (lse != nullptr) writer->Data(*lse, buffer);
  writer->Header(rest_bytes);
}

}  // namespace

std::shared_ptr<AnswerBuffer> AnswerBuffer::Acquire(PinnedPool* pool, size_t out_bytes,
                                                    size_t lse_bytes) {
  const size_t lse_offset = AlignUp(out_bytes);
  const size_t total = lse_offset + AlignUp(lse_bytes);
  if (pool == nullptr || total == 0) return nullptr;
  PinnedPool::Buffer buffer = pool->Acquire(total);
  if (!buffer) return nullptr;
  const kvcache::BytesAt at =
      pool->options().page_locked ? kvcache::BytesAt::kPageLocked : kvcache::BytesAt::kHost;
  std::shared_ptr<AnswerBuffer> answer(new AnswerBuffer(std::move(buffer), at));
  answer->out_ = {0, out_bytes};
  answer->lse_ = {lse_offset, lse_offset + lse_bytes};
  return answer;
}

char* AnswerBuffer::Take(Part* part, size_t bytes, const v1::Tensor* tensor) {
  if (bytes > part->end - part->next) return nullptr;
  char* data = buffer_.data() + part->next;
  part->next += bytes;
  spans_.push_back({tensor, data, bytes});
  return data;
}

AnswerPieces EncodeDecodeStepAnswer(v1::DecodeStepResponse* response, const AnswerBuffer* buffer) {
  // The spans were taken in result order (each item's O, then its LSE): walk them alongside.
  const std::vector<AnswerBuffer::Span> none;
  const std::vector<AnswerBuffer::Span>& spans = buffer != nullptr ? buffer->spans() : none;
  size_t next = 0;
  auto take = [&](const v1::Tensor* tensor) -> const AnswerBuffer::Span* {
    if (next == spans.size() || spans[next].tensor != tensor) return nullptr;
    return &spans[next++];
  };
  AnswerPieces answer;
  PieceWriter writer(&answer);
  // A packed answer's tensors were taken before any result's, and go first: a client finds their
  // data without walking the results (field order means nothing to a parser).
  if (response->has_packed()) {
    const v1::PackedDecodeAnswer& packed = response->packed();
    const AnswerBuffer::Span* out = packed.has_out() ? take(&packed.out()) : nullptr;
    const AnswerBuffer::Span* lse = packed.has_lse() ? take(&packed.lse()) : nullptr;
    if (out != nullptr || lse != nullptr) {
      WriteSpliced(kPackedField, packed, out, lse, *buffer, &writer);
      response->clear_packed();
    }
  }
  for (const v1::DecodeResult& result : response->results()) {
    const AnswerBuffer::Span* out = result.has_out() ? take(&result.out()) : nullptr;
    const AnswerBuffer::Span* lse = result.has_lse() ? take(&result.lse()) : nullptr;
    if (out != nullptr || lse != nullptr) {
      WriteSpliced(kResultsField, result, out, lse, *buffer, &writer);
      continue;
    }
    const std::string body = result.SerializeAsString();
    std::string head;
    AppendTag(kResultsField, &head);
    AppendVarint(body.size(), &head);
    writer.Header(head);
    writer.Header(body);
  }
  response->clear_results();
  writer.Header(response->SerializeAsString());
  return answer;
}

}  // namespace flashserve
