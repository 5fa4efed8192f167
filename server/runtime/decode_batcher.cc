#include "runtime/decode_batcher.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace flashserve {

DecodeBatcher::DecodeBatcher(absl::Duration window, int max_sequences,
                             std::function<void(Batch)> flush)
    : window_(window),
      max_sequences_(max_sequences),
      flush_(std::move(flush)),
      thread_([this] { Loop(); }) {}

DecodeBatcher::~DecodeBatcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

absl::Status DecodeBatcher::Add(std::shared_ptr<DecodeCall> call, int sequences) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("server shutting down");
    if (pending_sequences_ + sequences > 4 * max_sequences_) {
      return absl::ResourceExhaustedError(absl::StrCat("decode batch queue full (",
                                                       pending_sequences_,
                                                       " sequences waiting; "
                                                       "4 x --max_batch_sequences)"));
    }
    if (pending_.empty()) first_arrival_ = std::chrono::steady_clock::now();
    pending_.push_back(std::move(call));
    pending_sequences_ += sequences;
  }
  cv_.notify_all();
  return absl::OkStatus();
}

void DecodeBatcher::Loop() {
  const auto window = absl::ToChronoMicroseconds(window_);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !pending_.empty(); });
    if (pending_.empty()) return;  // stop_ and nothing left
    // The window starts with the batch's first call; a full batch goes at once.
    cv_.wait_until(lock, first_arrival_ + window,
                   [this] { return stop_ || pending_sequences_ >= max_sequences_; });
    Batch batch = std::move(pending_);
    pending_.clear();
    pending_sequences_ = 0;
    lock.unlock();
    flush_(std::move(batch));
    lock.lock();
  }
}

}  // namespace flashserve
