#include "gpu_test_support.h"

#include <errno.h>  // program_invocation_short_name (glibc): names the binary in the seed line

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <thread>

#include "flashserve/kernels/float_convert.h"

namespace flashserve::kernels::testing_util {

bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

bool gpu_required() {
  const char* v = std::getenv("FLASHSERVE_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

int device_compute_major() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major;
}

bool compiled(DType dtype, int head_dim) {
  return !cuda::candidates(dtype, head_dim, false).empty();
}

cudaError_t multiprocessor_count(int* count) {
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, 0);
}

// FLASHSERVE_TEST_SEED as a number (decimal, or 0x hex), or false when unset or not a number.
bool replay_seed(uint64_t* seed) {
  const char* text = std::getenv("FLASHSERVE_TEST_SEED");
  if (text == nullptr) return false;
  char* end = nullptr;
  errno = 0;
  *seed = std::strtoull(text, &end, 0);
  if (end == text || *end != '\0' || errno != 0) {
    ADD_FAILURE() << "FLASHSERVE_TEST_SEED=" << text << " is not a seed (a number as printed)";
    return false;
  }
  return true;
}

uint64_t run_seed() {
  static const uint64_t seed = [] {
    uint64_t s = 0;
    if (!replay_seed(&s)) {
      std::random_device rd;
      s = (uint64_t(rd()) << 32) ^ rd();
    }
    // Printed once, at the first use, so a failing run's log holds it. The seed stays the
    // line's last word: kernels/cuda/sm90/tools/gpu_check.sh collects it from there.
    std::printf("%s seed: %llu\n(FLASHSERVE_TEST_SEED=%llu replays this run)\n",
                program_invocation_short_name, static_cast<unsigned long long>(s),
                static_cast<unsigned long long>(s));
    std::fflush(stdout);
    return s;
  }();
  return seed;
}

uint64_t case_seed(const std::string& case_name) {
  return run_seed() ^ std::hash<std::string>{}(case_name);
}

uint16_t to_bits(DType dtype, float x) {
  return dtype == DType::kFloat16 ? float_to_half(x) : float_to_bf16(x);
}

double to_double(DType dtype, uint16_t bits) {
  return dtype == DType::kFloat16 ? half_to_float(bits) : bf16_to_float(bits);
}

std::vector<double> to_double(DType dtype, const std::vector<uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = to_double(dtype, bits[i]);
  return out;
}

std::vector<uint16_t> random_tensor(DType dtype, size_t n, float scale, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> t(n);
  for (uint16_t& x : t) x = to_bits(dtype, normal(rng) * scale);
  return t;
}

size_t q_elements(const AttentionParams& p) { return size_t(p.q_batch_stride) * p.batch; }
size_t kv_elements(const AttentionParams& p) { return size_t(p.k_batch_stride) * p.batch; }
size_t lse_elements(const AttentionParams& p) { return size_t(p.batch) * p.heads_q * p.seqlen_q; }

HostQkv random_qkv(AttentionParams* p, float input_scale, std::mt19937_64& rng) {
  HostQkv t;
  t.q = random_tensor(p->dtype, q_elements(*p), input_scale, rng);
  t.k = random_tensor(p->dtype, kv_elements(*p), input_scale, rng);
  t.v = random_tensor(p->dtype, kv_elements(*p), 1.f, rng);  // V has K's layout
  p->q = t.q.data();
  p->k = t.k.data();
  p->v = t.v.data();
  return t;
}

void pad_strides(AttentionParams* p, int extra_heads, int extra_rows) {
  const int64_t d = p->head_dim;
  p->q_row_stride = p->o_row_stride = (p->heads_q + extra_heads) * d;
  p->q_batch_stride = p->o_batch_stride = p->q_row_stride * (p->seqlen_q + extra_rows);
  p->k_row_stride = p->v_row_stride = (p->heads_kv + extra_heads) * d;
  p->k_batch_stride = p->v_batch_stride = p->k_row_stride * (p->seqlen_k + extra_rows);
}

ErrorStats error_vs(const std::vector<double>& x, const std::vector<double>& ref) {
  ErrorStats e;
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    e.max_abs = std::max(e.max_abs, std::abs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  e.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return e;
}

double lse_error(const std::vector<double>& lse, const std::vector<double>& ref) {
  double worst = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) worst = std::max(worst, std::abs(lse[i] - ref[i]));
  return worst;
}

reference::EmulationOptions emulation_options(const cuda::KernelConfig& cfg) {
  reference::EmulationOptions options;
  options.block_n = cfg.block_n;
  options.backwards = true;  // the kernels walk the key blocks from the last one
  options.rescale_threshold_log2 = cfg.rescale_threshold_log2();
  return options;
}

Fp64Reference::Fp64Reference(const AttentionParams& host_p) : host_p_(host_p) {
  reference::attention_fp64(host_p_, &out_, &lse_);
}

const EmulatedError& Fp64Reference::emulated(const reference::EmulationOptions& options) {
  for (const EmulatedError& e : emulated_)
    if (e.options.block_n == options.block_n && e.options.backwards == options.backwards &&
        e.options.rescale_threshold_log2 == options.rescale_threshold_log2)
      return e;
  std::vector<double> emu_out, emu_lse;
  reference::attention_emulated(host_p_, options, &emu_out, &emu_lse);
  emulated_.push_back({options, error_vs(emu_out, out_), lse_error(emu_lse, lse_)});
  return emulated_.back();
}

::testing::AssertionResult all_finite(const std::vector<double>& out) {
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i]) && bad++ == 0) first = i;
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " NaN/Inf (or unwritten) output elements, the "
                                       << "first at " << first;
}

::testing::AssertionResult nan_only_where_read(const RunAnswers& clean, const RunAnswers& got,
                                               int rows, int heads, int head_dim,
                                               const std::function<size_t(int, int)>& lse_at,
                                               const std::function<bool(int, int)>& read_nan) {
  double max_abs = 0;
  for (double x : clean.out) max_abs = std::max(max_abs, std::fabs(x));
  int poisoned = 0;
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h) {
      const size_t o0 = (size_t(r) * heads + h) * head_dim;
      const float lse = got.lse[lse_at(r, h)], want_lse = clean.lse[lse_at(r, h)];
      const auto where = [&] { return "row " + std::to_string(r) + " head " + std::to_string(h); };
      if (read_nan(r, h)) {
        ++poisoned;
        for (int i = 0; i < head_dim; ++i)
          if (!std::isnan(got.out[o0 + i]))
            return ::testing::AssertionFailure()
                   << where() << " read a NaN but O[" << i << "] = " << got.out[o0 + i];
        if (!std::isnan(lse))
          return ::testing::AssertionFailure() << where() << " read a NaN but LSE = " << lse;
        continue;
      }
      for (int i = 0; i < head_dim; ++i)
        if (!(std::fabs(got.out[o0 + i] - clean.out[o0 + i]) <= 0.02 * max_abs))
          return ::testing::AssertionFailure()
                 << where() << " did not read the NaN but O[" << i << "] = " << got.out[o0 + i]
                 << " vs " << clean.out[o0 + i] << " without it";
      const bool same_lse =
          std::isinf(want_lse) ? lse == want_lse : std::fabs(lse - want_lse) <= 1e-3;
      if (!same_lse)
        return ::testing::AssertionFailure() << where() << " did not read the NaN but LSE = " << lse
                                             << " vs " << want_lse << " without it";
    }
  if (poisoned == 0 || poisoned == rows * heads)
    return ::testing::AssertionFailure()
           << poisoned << " of " << rows * heads << " rows read the NaN: the case tests nothing";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult within_twice_emulated(const ErrorStats& err, const ErrorStats& emu) {
  const bool max_ok = err.max_abs <= 2 * emu.max_abs + 1e-6;
  const bool l2_ok = err.rel_l2 <= 2 * emu.rel_l2 + 1e-6;
  if (max_ok && l2_ok) return ::testing::AssertionSuccess();
  ::testing::AssertionResult failure = ::testing::AssertionFailure();
  if (!max_ok) failure << "max abs error " << err.max_abs << " vs emulated " << emu.max_abs << "; ";
  if (!l2_ok) failure << "relative L2 error " << err.rel_l2 << " vs emulated " << emu.rel_l2;
  return failure;
}

::testing::AssertionResult lse_matches(const std::vector<float>& lse,
                                       const std::vector<double>& ref, double emulated_lse_error) {
  double worst_excess = -std::numeric_limits<double>::infinity();
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0))
        return ::testing::AssertionFailure()
               << "LSE row " << i << " sees no key: must be -inf, got " << lse[i];
      continue;
    }
    if (!std::isfinite(lse[i]))
      return ::testing::AssertionFailure() << "LSE row " << i << " = " << lse[i];
    const double allowed = 2 * emulated_lse_error + 1e-4 + 4e-6 * std::abs(ref[i]);
    const double excess = std::abs(lse[i] - ref[i]) - allowed;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  if (!(worst_excess > 0)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "LSE row " << worst << " = " << lse[worst] << " vs fp64 " << ref[worst]
         << ": exceeds its allowance by " << worst_excess << " (emulated error "
         << emulated_lse_error << ")";
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)), cudaSuccess);
}

DeviceProblem::DeviceProblem(const AttentionParams& host_p)
    : q(q_elements(host_p) * 2),
      k(kv_elements(host_p) * 2),
      v(kv_elements(host_p) * 2),
      o(q_elements(host_p) * 2),  // O has Q's layout
      lse(lse_elements(host_p) * 4) {}

cudaError_t DeviceProblem::upload(const AttentionParams& host_p) {
  const size_t q_bytes = q_elements(host_p) * 2, kv_bytes = kv_elements(host_p) * 2;
  cudaError_t e = cudaMemcpy(q.get(), host_p.q, q_bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemcpy(k.get(), host_p.k, kv_bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaMemcpy(v.get(), host_p.v, kv_bytes, cudaMemcpyHostToDevice);
  return e;
}

cudaError_t DeviceProblem::poison() {
  const cudaError_t e = o.poison();
  return e != cudaSuccess ? e : lse.poison();
}

AttentionParams DeviceProblem::params(const AttentionParams& host_p, bool with_lse) const {
  AttentionParams p = host_p;
  p.q = q.get();
  p.k = k.get();
  p.v = v.get();
  p.o = o.get();
  p.lse = with_lse ? lse.as<float>() : nullptr;
  return p;
}

std::vector<double> gather_output(const AttentionParams& p, const std::vector<uint16_t>& o) {
  const int d = p.head_dim;
  std::vector<double> out(size_t(p.batch) * p.seqlen_q * p.heads_q * d);
  for (int b = 0; b < p.batch; ++b)
    for (int i = 0; i < p.seqlen_q; ++i)
      for (int h = 0; h < p.heads_q; ++h)
        for (int c = 0; c < d; ++c)
          out[((size_t(b) * p.seqlen_q + i) * p.heads_q + h) * d + c] = to_double(
              p.dtype, o[b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride + c]);
  return out;
}

StreamGate::StreamGate(cudaStream_t stream) {
  EXPECT_EQ(cudaLaunchHostFunc(stream, &StreamGate::wait, &state_), cudaSuccess);
}

void CUDART_CB StreamGate::wait(void* arg) {
  auto* state = static_cast<State*>(arg);
  const auto deadline = std::chrono::steady_clock::now() + kLimit;
  while (!state->open.load()) {
    if (std::chrono::steady_clock::now() > deadline) {
      state->timed_out.store(true);
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace flashserve::kernels::testing_util
