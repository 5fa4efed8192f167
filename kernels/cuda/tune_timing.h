// The autotuners' timing loop, shared by tune() (tuner.cu) and tune_decode_splits()
// (decode/decode_tune.cu): CUDA events around each launch, `warmup` untimed rounds, then
// `repetitions` timed rounds, the median per candidate. Each round launches every candidate once
// (interleaved, so clock or thermal drift during tuning affects all of them alike). Nothing waits
// for the GPU until the one synchronization at the end: the warm-up launches are queued first, and
// each timed launch with its event pair after them, so the timed kernels start with work queued
// ahead of them and run back to back while the host stays ahead (a kernel shorter than the host's
// time to queue one launch can still drain that queue). Never throws except std::bad_alloc.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

namespace flashserve::kernels::cuda {

/// Events created for one timing run and destroyed with it (on every path).
class TimingEvents {
 public:
  TimingEvents() = default;
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
  ~TimingEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  cudaError_t create(size_t n) {
    events_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      if (cudaError_t err = cudaEventCreate(&e); err != cudaSuccess) return err;
      events_.push_back(e);
    }
    return cudaSuccess;
  }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

/// The median of `v` (the mean of the two middle values for an even count; 0 when empty).
inline double median_ms(std::vector<float> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (double(v[n / 2 - 1]) + v[n / 2]);
}

/// Times `candidates` launchers: `launch(c)` (0 <= c < candidates) queues candidate c on `stream`
/// (the caller rotates its input sets there) and returns its launch error. On success
/// (*medians)[c] is candidate c's median time in ms over `repetitions` timed launches.
template <typename Launch>
cudaError_t time_interleaved(int candidates, int warmup, int repetitions, cudaStream_t stream,
                             Launch&& launch, std::vector<double>* medians) {
  const size_t n = size_t(std::max(candidates, 0)), reps = size_t(std::max(repetitions, 0));
  for (int w = 0; w < warmup; ++w)
    for (size_t c = 0; c < n; ++c)
      if (cudaError_t err = launch(int(c)); err != cudaSuccess) return err;
  TimingEvents events;
  if (cudaError_t err = events.create(2 * reps * n); err != cudaSuccess) return err;
  for (size_t k = 0; k < reps * n; ++k) {  // k = repetition * n + candidate
    if (cudaError_t err = cudaEventRecord(events[2 * k], stream); err != cudaSuccess) return err;
    if (cudaError_t err = launch(int(k % n)); err != cudaSuccess) return err;
    if (cudaError_t err = cudaEventRecord(events[2 * k + 1], stream); err != cudaSuccess)
      return err;
  }
  if (cudaError_t err = cudaStreamSynchronize(stream); err != cudaSuccess) return err;
  medians->assign(n, 0.0);
  for (size_t c = 0; c < n; ++c) {
    std::vector<float> ms(reps);
    for (size_t r = 0; r < reps; ++r) {
      const size_t k = r * n + c;
      if (cudaError_t err = cudaEventElapsedTime(&ms[r], events[2 * k], events[2 * k + 1]);
          err != cudaSuccess)
        return err;
    }
    (*medians)[c] = median_ms(std::move(ms));
  }
  return cudaSuccess;
}

}  // namespace flashserve::kernels::cuda
