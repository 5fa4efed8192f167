// Collects decode calls and hands them on together, so calls of different clients run as one
// paged launch: those that arrive within a window (--batch_window_us) of the first waiting one,
// and/or (--batch_when_busy) those that arrive while `max_running` batches are still running
// (--decode_launches_in_flight) -- which adds no wait when the server is idle. Bounded: a batch is
// handed on early when it holds max_sequences sequences, and calls beyond 4x that wait nowhere
// (refused). A call that is cancelled or whose deadline passes while it waits is answered then
// (CANCELLED / DEADLINE_EXCEEDED, nothing appended), not when a batch finally takes it: its place
// in the bounded queue and its in-flight bytes are freed for live calls.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace flashserve {

struct DecodeCall;

/// Thread-safe. One thread waits out the windows.
class DecodeBatcher {
 public:
  using Batch = std::vector<std::shared_ptr<DecodeCall>>;
  /// `flush` receives each batch on the batcher's thread, or (when_busy with room, no window) on
  /// the thread that called Add (on_caller_thread). when_busy: a batch is handed on only while
  /// fewer than `max_running` are running (not yet BatchDone); what arrives meanwhile joins the
  /// next.
  using Flush = std::function<void(Batch, bool on_caller_thread)>;
  DecodeBatcher(absl::Duration window, int max_sequences, bool when_busy, int max_running,
                Flush flush);
  /// Stop().
  ~DecodeBatcher();
  /// Hands on what is pending, joins the thread and waits (up to 10 s) until every batch handed
  /// on is done (BatchDone), so the batches' runner may still call BatchDone meanwhile.
  void Stop();

  /// RESOURCE_EXHAUSTED (nothing kept) when too much is pending already.
  absl::Status Add(std::shared_ptr<DecodeCall> call, int sequences);
  /// A batch handed to `flush` has been answered (call exactly once per batch; with when_busy
  /// the next batch waits for it).
  void BatchDone();

 private:
  void Loop();
  // Waits (the lock held between checks) until `ready`, answering the pending calls that went
  // stale meanwhile (polled: cancellation is not signalled).
  template <typename Ready>
  void WaitAnsweringStale(std::unique_lock<std::mutex>& lock,
                          std::chrono::steady_clock::time_point until, Ready ready);
  // Takes the stale calls out of pending_ and answers them (without the lock).
  void AnswerStale(std::unique_lock<std::mutex>& lock);

  const absl::Duration window_;
  const int max_sequences_;
  const bool when_busy_;
  const int max_running_;
  static constexpr std::chrono::milliseconds kStalePoll{5};
  static constexpr std::chrono::steady_clock::time_point kForever =
      std::chrono::steady_clock::time_point::max();
  const Flush flush_;
  std::mutex mu_;
  std::condition_variable cv_;
  Batch pending_;
  int pending_sequences_ = 0;
  int batches_running_ = 0;  // handed to flush, not yet BatchDone
  std::chrono::steady_clock::time_point first_arrival_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace flashserve
