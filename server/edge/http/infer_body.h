// The body of one KServe REST inference as it arrives: its JSON header, then each binary input
// straight into its tensor (the only copy of the tensor bytes on the way in), every byte counted
// against the HTTP edge's receive budget, and the answer's bytes counted before anything runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "edge/http/kserve_json.h"

namespace flashserve {

/// The bytes of request bodies the HTTP edge holds at once (JSON text and binary inputs, from
/// their arrival until the request is answered). Thread-safe.
class ReceiveBudget {
 public:
  explicit ReceiveBudget(int64_t limit) : limit_(limit) {}
  /// RESOURCE_EXHAUSTED (503: retry later) when `bytes` more would pass the limit.
  absl::Status Take(int64_t bytes);
  int64_t limit() const { return limit_; }
  void Give(int64_t bytes) { used_.fetch_sub(bytes); }
  int64_t used() const { return used_.load(); }

 private:
  const int64_t limit_;
  std::atomic<int64_t> used_{0};
};


// Budget for a JSON output element while its answer is built and sent: nlohmann's value (16 B)
// and its text (up to 25 B: 17 significant digits of a double, sign, exponent, comma), then
// libmicrohttpd's copy of the text. Measured: 15 B of text per fp16 element.
inline constexpr int64_t kJsonAnswerBytesPerElement = 48;

// JSON headers of at least this many bytes are parsed later, off the listener thread
// (InferBodyReader::ParsesLater): a 27 MiB number array took 0.82 s to post and refuse
// (~29 ns per byte, 2-core machine), and a listener thread busy with a 64 MiB one (~1.9 s) held up every request of its connections, health probes included.
// Below it (< ~7 ms) the hop to another thread would cost more than it saves.
inline constexpr int64_t kInlineJsonParseBytes = 256 << 10;

struct KServeRestLimits {
  int64_t max_request_bytes = int64_t{1} << 30;  // whole body (413 beyond)
  int64_t max_json_bytes = int64_t{64} << 20;    // JSON part of a body (413 beyond)
  std::shared_ptr<ReceiveBudget> budget;         // may be null: no edge-wide bound
  // JSON headers of at least this many bytes are parsed later (kInlineJsonParseBytes; tests and
  // fuzzers lower it to drive the stash with small bodies).
  int64_t inline_parse_bytes = kInlineJsonParseBytes;
};

/// Elements of O and LSE an answer to `r` holds, in JSON and bytes in binary (outputs in a
/// client's region: none).
struct AnswerElements {
  int64_t json = 0;
  int64_t binary_bytes = 0;
};
AnswerElements AnswerElementsOf(const kserve::RestInferRequest& r);

/// Bytes taken from the receive budget, given back when the request is over. Not thread-safe.
class BudgetHold {
 public:
  explicit BudgetHold(std::shared_ptr<ReceiveBudget> budget) : budget_(std::move(budget)) {}
  ~BudgetHold() {
    if (budget_) budget_->Give(held_);
  }
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;
  /// 413 when this request alone can never fit the budget, 503 (retry later) when it is full now.
  absl::Status Take(int64_t bytes);
  /// Gives back `bytes` taken earlier (memory freed before the request is over).
  void Give(int64_t bytes);
  int64_t held() const { return held_; }

 private:
  std::shared_ptr<ReceiveBudget> budget_;
  int64_t held_ = 0;
};

/// Routes the bytes of one infer body as they arrive. Not thread-safe: one per request, used by
/// one thread at a time.
class InferBodyReader {
 public:
  /// header_length: Inference-Header-Content-Length (-1: the whole body is JSON);
  /// content_length: -1 for a chunked body.
  InferBodyReader(int64_t header_length, int64_t content_length, const KServeRestLimits& limits,
                  const ValidationLimits* validation, BudgetHold* hold)
      : header_length_(header_length),
        content_length_(content_length),
        limits_(limits),
        validation_(validation),
        hold_(hold) {}

  /// The JSON header's length is known from the request's headers: refuse before any body byte.
  absl::Status CheckHeaderLength() const;
  absl::Status Consume(const char* data, size_t n);
  /// Whether Finish has a JSON header of limits.inline_parse_bytes or more left to parse.
  bool ParsesLater() const;
  /// After the body ended: parses what is left; OK when the request is complete.
  absl::Status Finish();

  kserve::RestInferRequest& request() { return request_; }

 private:
  enum class State {
    kHeader,   // collecting the JSON header
    kBinary,   // filling binary inputs, in input order
    kStashed,  // the header is whole and large: binary bytes wait in stash_ for Finish's parse
  };

  absl::Status JsonTooLarge() const;
  absl::Status TakeAnswerBytes();
  absl::Status ParseHeader();
  absl::Status ConsumeBinary(const char* data, size_t n);
  absl::Status FillFromStash();
  void SkipFilledTargets();

  const int64_t header_length_;
  const int64_t content_length_;
  const KServeRestLimits limits_;
  const ValidationLimits* const validation_;
  BudgetHold* const hold_;
  State state_ = State::kHeader;
  std::string header_;
  std::string stash_;  // binary bytes that came before their header was parsed (kStashed)
  int64_t received_ = 0;
  kserve::RestInferRequest request_;
  size_t target_ = 0;  // binary input being filled
};

}  // namespace flashserve
