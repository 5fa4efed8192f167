#include "runtime/decode_batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flashserve {

DecodeBatcher::DecodeBatcher(absl::Duration window, int max_sequences, bool when_busy,
                             int max_running, Flush flush)
    : window_(window),
      max_sequences_(max_sequences),
      when_busy_(when_busy),
      max_running_(std::max(max_running, 1)),
      flush_(std::move(flush)),
      thread_([this] { Loop(); }) {}

DecodeBatcher::~DecodeBatcher() { Stop(); }

void DecodeBatcher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::seconds(10), [this] { return batches_running_ == 0; });
}

absl::Status DecodeBatcher::Add(std::shared_ptr<DecodeCall> call, int sequences) {
  bool idle = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return absl::UnavailableError("server shutting down");
    if (pending_sequences_ + sequences > 4 * max_sequences_) {
      return absl::ResourceExhaustedError(absl::StrCat("decode batch queue full (",
                                                       pending_sequences_,
                                                       " sequences waiting; "
                                                       "4 x --max_batch_sequences)"));
    }
    if (when_busy_ && window_ == absl::ZeroDuration() && batches_running_ < max_running_ &&
        pending_.empty()) {
      ++batches_running_;  // room: hand it on from this thread (no hop through the batcher's)
      idle = true;
    } else {
      if (pending_.empty()) first_arrival_ = std::chrono::steady_clock::now();
      pending_.push_back(std::move(call));
      pending_sequences_ += sequences;
    }
  }
  if (idle) {
    flush_(Batch{std::move(call)}, true);
  } else {
    cv_.notify_all();
  }
  return absl::OkStatus();
}

void DecodeBatcher::BatchDone() {
  // Notify under the lock: once batches_running_ reaches 0, Stop() may return and the batcher be
  // destroyed, so this thread must not touch cv_ after releasing mu_.
  std::lock_guard<std::mutex> lock(mu_);
  --batches_running_;
  cv_.notify_all();
}

void DecodeBatcher::Loop() {
  const auto window = absl::ToChronoMicroseconds(window_);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // when_busy: a running batch must be done first (at shutdown: go at once).
    cv_.wait(lock, [this] {
      return stop_ || (!pending_.empty() && !(when_busy_ && batches_running_ >= max_running_));
    });
    if (pending_.empty()) return;  // stop_ and nothing left
    // The window starts with the batch's first call; a full batch goes at once.
    if (window.count() > 0) {
      cv_.wait_until(lock, first_arrival_ + window,
                     [this] { return stop_ || pending_sequences_ >= max_sequences_; });
    }
    // Everything waiting goes (the runtime splits it into launches of max_sequences).
    Batch batch = std::move(pending_);
    pending_.clear();
    pending_sequences_ = 0;
    ++batches_running_;
    lock.unlock();
    flush_(std::move(batch), false);
    lock.lock();
  }
}

}  // namespace flashserve
