// What the GPU kernel tests share, so each test file holds only its own cases and special checks:
// GPU presence and skips, run seeds (fresh, printed, replayable), random fp16/bf16 inputs, the
// fp64 reference with its same-precision emulations (the yardstick for tolerances), the error
// and LSE checks, and device buffers that are NaN-poisoned before each launch.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "flashserve/kernels/reference_attention.h"
#include "gtest/gtest.h"

namespace flashserve::kernels::testing_util {

// ---- GPU presence -----------------------------------------------------------------------------

bool gpu_available();
/// FLASHSERVE_REQUIRE_GPU=1: a missing GPU fails the GPU tests instead of skipping them.
bool gpu_required();
/// The current device's compute capability major, 0 without a GPU.
int device_compute_major();

/// Whether kernels for (dtype, head_dim) were instantiated in this build.
bool compiled(DType dtype, int head_dim);

/// Streaming multiprocessors of device 0 (what select() sizes its grids for).
cudaError_t multiprocessor_count(int* count);

// ---- Seeds ------------------------------------------------------------------------------------

/// This run's base seed: fresh each run and printed once ("<binary> seed: N"), or
/// FLASHSERVE_TEST_SEED=N to replay a failing run.
uint64_t run_seed();

/// A seed for one case: the run seed mixed with the case's name, so cases differ from each
/// other and each one replays alone (--gtest_filter) with the same inputs.
uint64_t case_seed(const std::string& case_name);

// ---- Random inputs ----------------------------------------------------------------------------

uint16_t to_bits(DType dtype, float x);  // fp16 or bf16 bits, round to nearest even
double to_double(DType dtype, uint16_t bits);
std::vector<double> to_double(DType dtype, const std::vector<uint16_t>& bits);

/// n values drawn from N(0, scale^2), rounded to dtype (fp16 or bf16).
std::vector<uint16_t> random_tensor(DType dtype, size_t n, float scale, std::mt19937_64& rng);

/// Host Q/K/V of one dense problem in its layout (padding included).
struct HostQkv {
  std::vector<uint16_t> q, k, v;
};

/// Fresh Q/K/V for p's dtype, shape and strides; Q and K scaled by input_scale (> 1: large
/// logits), V not. Points p->q/k/v at the returned vectors (their buffers survive a move).
HostQkv random_qkv(AttentionParams* p, float input_scale, std::mt19937_64& rng);

/// Pads every row of Q/K/V/O by extra_heads heads and every batch by extra_rows rows: the
/// non-contiguous views a server batching requests passes.
void pad_strides(AttentionParams* p, int extra_heads, int extra_rows);

/// Elements (padding included) of Q / of K and V / of O / of the LSE for p's layout.
size_t q_elements(const AttentionParams& p);
size_t kv_elements(const AttentionParams& p);
size_t lse_elements(const AttentionParams& p);

// ---- References and errors --------------------------------------------------------------------

struct ErrorStats {
  double max_abs = 0;  // max |x - ref|
  double rel_l2 = 0;   // ||x - ref|| / ||ref||
};

ErrorStats error_vs(const std::vector<double>& x, const std::vector<double>& ref);

/// Max |lse - ref| over the rows that see a key (ref finite).
double lse_error(const std::vector<double>& lse, const std::vector<double>& ref);

/// How configuration cfg rounds P: its key blocks, walked backwards, and its rescale threshold.
reference::EmulationOptions emulation_options(const cuda::KernelConfig& cfg);

/// A same-precision emulation's error against fp64.
struct EmulatedError {
  reference::EmulationOptions options;
  ErrorStats out;
  double lse = 0;  // lse_error of the emulation
};

/// A dense problem's fp64 reference and, per emulation asked for, that emulation's error
/// against it (each computed once: they cost as much as the reference). The host tensors
/// host_p points at must outlive it.
class Fp64Reference {
 public:
  explicit Fp64Reference(const AttentionParams& host_p);
  const std::vector<double>& out() const { return out_; }  // [batch, seqlen_q, heads_q, d]
  const std::vector<double>& lse() const { return lse_; }  // [batch, heads_q, seqlen_q]
  const EmulatedError& emulated(const reference::EmulationOptions& options);
  const EmulatedError& emulated(const cuda::KernelConfig& cfg) {
    return emulated(emulation_options(cfg));
  }

 private:
  AttentionParams host_p_;
  std::vector<double> out_, lse_;
  std::deque<EmulatedError> emulated_;  // a deque: references handed out stay valid
};

// ---- Checks -----------------------------------------------------------------------------------

/// No NaN/Inf in a kernel's output: the poison left in an element nobody wrote is NaN.
::testing::AssertionResult all_finite(const std::vector<double>& out);

/// The output tolerance: at most 2x the emulation's error, max abs and relative L2 each (plus
/// one part in 1e6, for cases where the emulation is exact, e.g. one key).
::testing::AssertionResult within_twice_emulated(const ErrorStats& err, const ErrorStats& emu);

/// The fp32 LSE rule: a row that sees no key is -inf; any other is finite and within 2x the
/// emulation's worst LSE error plus the approximate exp2 (1e-4) and the tensor cores' fp32
/// accumulation (not rounded per step: ~2^-22 of the logit, seen as 3.4e-4 at LSE ~ 200 with
/// 8x-scaled inputs). Names the worst row.
::testing::AssertionResult lse_matches(const std::vector<float>& lse,
                                       const std::vector<double>& ref, double emulated_lse_error);

/// One run's answers for expect_nan_where_read: O as doubles in [row, head, d] order and the LSEs.
struct RunAnswers {
  std::vector<double> out;
  std::vector<float> lse;
};

/// A run on inputs that hold a NaN against the same run on the clean inputs: the (row, head)
/// pairs `read_nan` names are NaN in every element of O and in the LSE (not 0 and -inf, which
/// say "saw no key", nor finite); every other pair is finite and agrees with the clean run
/// (2% of max |O|: the kernels' rescale decisions may differ; 1e-3 in LSE). `lse_at` indexes
/// the LSEs. Fails when no pair, or every pair, reads the NaN (the case would test nothing).
::testing::AssertionResult nan_only_where_read(const RunAnswers& clean, const RunAnswers& got,
                                               int rows, int heads, int head_dim,
                                               const std::function<size_t(int, int)>& lse_at,
                                               const std::function<bool(int, int)>& read_nan);

// ---- Device memory ----------------------------------------------------------------------------

/// Memset byte of the poison: 0xFFFF is NaN in fp16 and bf16, 0xFFFFFFFF in fp32.
constexpr int kPoisonByte = 0xFF;

/// A device allocation owned by one test. Never empty (16 bytes at least), so a kernel given a
/// zero-sized tensor still gets an aligned, valid pointer.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  /// The bytes asked for (the allocation holds at least 16).
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  /// Fills the buffer (the bytes asked for) with NaN.
  cudaError_t poison() { return cudaMemset(ptr_, kPoisonByte, bytes_); }
  /// Copies host (host.size() elements) to the start of the buffer.
  template <typename T>
  cudaError_t upload(const std::vector<T>& host) {
    return cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  /// Copies the first host->size() elements of the buffer to host.
  template <typename T>
  cudaError_t download(std::vector<T>* host) const {
    return cudaMemcpy(host->data(), ptr_, host->size() * sizeof(T), cudaMemcpyDeviceToHost);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// One dense problem on the device: Q/K/V copied from the host, O (host_p's layout) and LSE.
struct DeviceProblem {
  explicit DeviceProblem(const AttentionParams& host_p);
  /// Copies the Q/K/V host_p points at (the layout it was made with).
  cudaError_t upload(const AttentionParams& host_p);
  /// NaN in every element of O (padding included) and of the LSE.
  cudaError_t poison();
  /// host_p's problem on these buffers; with_lse: the kernel writes the LSE too.
  AttentionParams params(const AttentionParams& host_p, bool with_lse) const;

  DeviceBuffer q, k, v, o, lse;
};

/// O as the kernel wrote it (host_p's strides) in the references' contiguous
/// [batch, seqlen_q, heads_q, head_dim] order, widened to double.
std::vector<double> gather_output(const AttentionParams& host_p, const std::vector<uint16_t>& o);

/// Holds a stream's queue behind a host function until release() (or destruction), or until
/// kLimit has passed: where the GPU runs one stream's work at a time (compute-sanitizer
/// serializes launches) nothing queued behind the gate could ever finish. Queue one launch of
/// each kernel first: lazy module loading while a stream is gated can deadlock.
class StreamGate {
 public:
  static constexpr auto kLimit = std::chrono::seconds(10);
  explicit StreamGate(cudaStream_t stream);
  ~StreamGate() { release(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  void release() { state_.open.store(true); }
  /// Whether the gate gave up waiting (the test then tested nothing: skip it).
  bool opened_by_itself() const { return state_.timed_out.load(); }

 private:
  struct State {
    std::atomic<bool> open{false}, timed_out{false};
  };
  static void CUDART_CB wait(void* state);
  State state_;
};

}  // namespace flashserve::kernels::testing_util

/// Skips the test without a GPU, or fails it with FLASHSERVE_REQUIRE_GPU=1 (set by the GPU
/// machine's scripts, where a GPU the tests cannot see must not pass as skips).
#define SKIP_WITHOUT_GPU()                                                \
  if (!::flashserve::kernels::testing_util::gpu_available()) {            \
    if (::flashserve::kernels::testing_util::gpu_required())              \
      FAIL() << "no CUDA GPU, and FLASHSERVE_REQUIRE_GPU=1 asks for one"; \
    GTEST_SKIP() << "no CUDA GPU: skipping";                              \
  }
