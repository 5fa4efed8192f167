// Collects decode calls that arrive within a window (--batch_window_us) and hands them on
// together, so calls of different clients run as one paged launch. Bounded: a batch is handed on
// early when it holds max_sequences sequences, and calls beyond 4x that wait nowhere (refused).
#pragma once

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
  /// `flush` receives each batch on the batcher's thread.
  DecodeBatcher(absl::Duration window, int max_sequences, std::function<void(Batch)> flush);
  /// Flushes what is pending, then joins its thread.
  ~DecodeBatcher();

  /// RESOURCE_EXHAUSTED (nothing kept) when too much is pending already.
  absl::Status Add(std::shared_ptr<DecodeCall> call, int sequences);

 private:
  void Loop();

  const absl::Duration window_;
  const int max_sequences_;
  const std::function<void(Batch)> flush_;
  std::mutex mu_;
  std::condition_variable cv_;
  Batch pending_;
  int pending_sequences_ = 0;
  std::chrono::steady_clock::time_point first_arrival_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace flashserve
