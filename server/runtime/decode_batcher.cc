#include "runtime/decode_batcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/decode_call.h"

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

void DecodeBatcher::AnswerStale(std::unique_lock<std::mutex>& lock) {
  const absl::Time now = absl::Now();
  std::vector<std::pair<std::shared_ptr<DecodeCall>, absl::Status>> stale;
  Batch live;
  for (std::shared_ptr<DecodeCall>& call : pending_) {
    absl::Status status = StaleCallStatus(*call, now);
    if (status.ok()) {
      live.push_back(std::move(call));
    } else {
      pending_sequences_ -= int(call->items.size());
      stale.emplace_back(std::move(call), std::move(status));
    }
  }
  pending_ = std::move(live);
  if (stale.empty()) return;
  lock.unlock();
  for (auto& [call, status] : stale) call->done(status, {});
  lock.lock();
}

template <typename Ready>
void DecodeBatcher::WaitAnsweringStale(std::unique_lock<std::mutex>& lock,
                                       std::chrono::steady_clock::time_point until, Ready ready) {
  while (!ready()) {
    if (pending_.empty() && until == kForever) {  // nothing to answer until a call comes
      cv_.wait(lock, [&] { return ready() || !pending_.empty(); });
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return;
    const auto wake = pending_.empty() ? until : std::min(until, now + kStalePoll);
    if (cv_.wait_until(lock, wake, ready)) return;
    AnswerStale(lock);
  }
}

void DecodeBatcher::Loop() {
  const auto window = absl::ToChronoMicroseconds(window_);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    // when_busy: a running batch must be done first (at shutdown: go at once).
    WaitAnsweringStale(lock, kForever, [this] {
      return stop_ || (!pending_.empty() && !(when_busy_ && batches_running_ >= max_running_));
    });
    if (pending_.empty()) return;  // stop_ and nothing left
    // The window starts with the batch's first call; a full batch goes at once.
    if (window.count() > 0) {
      WaitAnsweringStale(lock, first_arrival_ + window,
                         [this] { return stop_ || pending_sequences_ >= max_sequences_; });
      if (pending_.empty()) continue;  // every call went stale in the window
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
