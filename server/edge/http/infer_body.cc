#include "edge/http/infer_body.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/http_status.h"
#include "common/status_macros.h"

namespace flashserve {

absl::Status ReceiveBudget::Take(int64_t bytes) {
  if (used_.fetch_add(bytes) + bytes > limit_) {
    used_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the HTTP edge holds its most request bytes (--http_max_receive_bytes=", limit_,
        "); retry later"));
  }
  return absl::OkStatus();
}

namespace {

// The bytes an answer to `r` holds until the client has read it: an unread JSON answer held ~15x
// its binary size outside every budget (15 answers of 30 MiB for 4 MiB requests: +569 MiB RSS).
int64_t AnswerBytesAtMost(const kserve::RestInferRequest& r) {
  const AnswerElements a = AnswerElementsOf(r);
  return a.binary_bytes + a.json * kJsonAnswerBytesPerElement;
}

}  // namespace

AnswerElements AnswerElementsOf(const kserve::RestInferRequest& r) {
  AnswerElements out;
  const auto& shape = r.request.q().shape();
  if (shape.size() != 4) return out;  // refused by validation before this
  const int64_t rows = int64_t(shape[0]) * shape[1] * shape[2];  // batch x seqlen_q x heads_q
  const int64_t elements[2] = {rows * shape[3], rows};           // O, LSE
  const int64_t element_bytes[2] = {
      int64_t(kernels::dtype_size(static_cast<kernels::DType>(r.request.q().dtype()))), 4};
  for (const kserve::OutputSpec& spec : r.outputs) {
    if (spec.shm.set()) continue;
    const int k = spec.kind == kserve::OutputSpec::kOut ? 0 : 1;
    if (spec.binary) {
      out.binary_bytes += elements[k] * element_bytes[k];
    } else {
      out.json += elements[k];
    }
  }
  return out;
}

absl::Status BudgetHold::Take(int64_t bytes) {
  if (!budget_ || bytes <= 0) return absl::OkStatus();
  if (held_ + bytes > budget_->limit()) {
    // This request alone can never fit: too large (413), not busy (503: retry later, forever).
    return absl::ResourceExhaustedError(
        absl::StrCat(kBodyOverLimit, "--http_max_receive_bytes=", budget_->limit(),
                     " (the bytes the HTTP edge holds at once, over all requests)"));
  }
  absl::Status s = budget_->Take(bytes);
  if (s.ok()) held_ += bytes;
  return s;
}

void BudgetHold::Give(int64_t bytes) {
  bytes = std::min(bytes, held_);
  if (!budget_ || bytes <= 0) return;
  budget_->Give(bytes);
  held_ -= bytes;
}

absl::Status InferBodyReader::CheckHeaderLength() const {
  const int64_t json_bytes = header_length_ >= 0 ? header_length_ : content_length_;
  if (json_bytes > limits_.max_json_bytes) return JsonTooLarge();
  if (header_length_ >= 0 && content_length_ >= 0 && header_length_ > content_length_) {
    return absl::InvalidArgumentError(
        absl::StrCat("Inference-Header-Content-Length=", header_length_, " exceeds the body's ",
                     content_length_, " bytes"));
  }
  return absl::OkStatus();
}

absl::Status InferBodyReader::Consume(const char* data, size_t n) {
  received_ += int64_t(n);
  if (state_ == State::kHeader) {
    size_t take = n;
    if (header_length_ >= 0) take = std::min(n, size_t(header_length_) - header_.size());
    if (int64_t(header_.size() + take) > limits_.max_json_bytes) return JsonTooLarge();
    RETURN_IF_ERROR(hold_->Take(int64_t(take)));
    header_.append(data, take);
    data += take;
    n -= take;
    if (header_length_ >= 0 && int64_t(header_.size()) == header_length_) {
      if (header_length_ >= limits_.inline_parse_bytes) {
        state_ = State::kStashed;
      } else {
        RETURN_IF_ERROR(ParseHeader());
      }
    }
  }
  if (n == 0) return absl::OkStatus();
  if (state_ == State::kStashed) {
    // Bounded by the route's body limit and, here, by the receive budget.
    RETURN_IF_ERROR(hold_->Take(int64_t(n)));
    stash_.append(data, n);
    return absl::OkStatus();
  }
  return ConsumeBinary(data, n);
}

absl::Status InferBodyReader::ConsumeBinary(const char* data, size_t n) {
  while (n > 0) {
    if (target_ == request_.binary_targets.size()) {
      return absl::InvalidArgumentError(
          "request body: more bytes than the inputs' binary_data_size add up to");
    }
    std::string* target = request_.binary_targets[target_];
    const size_t take = std::min(n, size_t(request_.binary_sizes[target_]) - target->size());
    target->append(data, take);  // into the reserved capacity: pages touched as bytes come
    data += take;
    n -= take;
    SkipFilledTargets();
  }
  return absl::OkStatus();
}

bool InferBodyReader::ParsesLater() const {
  return state_ == State::kStashed ||
         (state_ == State::kHeader && header_length_ < 0 &&
          int64_t(header_.size()) >= limits_.inline_parse_bytes);
}

absl::Status InferBodyReader::Finish() {
  if (state_ == State::kHeader) {
    if (header_length_ >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request body ended after ", received_,
          " bytes, inside its JSON header (Inference-Header-Content-Length=", header_length_,
          ")"));
    }
    RETURN_IF_ERROR(ParseHeader());
  } else if (state_ == State::kStashed) {
    RETURN_IF_ERROR(ParseHeader());
    RETURN_IF_ERROR(FillFromStash());
  }
  if (target_ < request_.binary_targets.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("request body ended before the binary data of its inputs did (", received_,
                     " bytes received)"));
  }
  return absl::OkStatus();
}

// The one extra copy of a body whose large header was parsed after its binary bytes came.
absl::Status InferBodyReader::FillFromStash() {
  const absl::Status s = ConsumeBinary(stash_.data(), stash_.size());
  hold_->Give(int64_t(stash_.size()));
  std::string().swap(stash_);
  return s;
}

absl::Status InferBodyReader::JsonTooLarge() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "request body: JSON header over --http_max_json_bytes=", limits_.max_json_bytes));
}

// The answer stays until the client has read it (--answer_timeout_s at most): its bytes count
// from now, before anything is computed. A request whose body and answer together could never
// fit the budget is refused as too large (413), not as busy (503: retry later).
absl::Status InferBodyReader::TakeAnswerBytes() {
  const int64_t bytes = AnswerBytesAtMost(request_);
  if (limits_.budget != nullptr && hold_->held() + bytes > limits_.budget->limit()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kBodyOverLimit, "what --http_max_receive_bytes=", limits_.budget->limit(),
        " can hold with its answer: the body holds ", hold_->held(),
        " bytes and the answer would hold ", bytes, " until it is read (a JSON output takes up to ",
        kJsonAnswerBytesPerElement,
        " bytes per element): ask for binary outputs (binary_data_output) or send less"));
  }
  return hold_->Take(bytes);
}

absl::Status InferBodyReader::ParseHeader() {
  const int64_t header_bytes = int64_t(header_.size());
  const int64_t binary_bytes = header_length_ < 0    ? 0
                               : content_length_ < 0 ? -1
                                                     : content_length_ - header_bytes;
  kserve::RestHeaderChecks checks;
  checks.validation = validation_;
  checks.reserve = [this](int64_t bytes) { return hold_->Take(bytes); };
  checks.capacity_only = true;
  absl::Status s = kserve::ParseRestInferHeader(
      header_, binary_bytes, limits_.max_request_bytes - header_bytes, &request_, checks);
  std::string().swap(header_);
  RETURN_IF_ERROR(s);
  RETURN_IF_ERROR(TakeAnswerBytes());
  state_ = State::kBinary;
  SkipFilledTargets();
  return absl::OkStatus();
}

void InferBodyReader::SkipFilledTargets() {
  while (target_ < request_.binary_targets.size() &&
         int64_t(request_.binary_targets[target_]->size()) == request_.binary_sizes[target_]) {
    ++target_;
  }
}

}  // namespace flashserve
