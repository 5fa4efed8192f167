// Variable-length prefill (AttentionParams::cu_seqlens_q/k) on the sm80 family: many sequences of
// different lengths packed into one q/k/v/o, run in one launch with the configuration that has a
// variable-length kernel (select()'s; the others must refuse). Each sequence is checked against a
// plain fp64 reference of that sequence alone (tolerance: 2x the error of the config's emulation,
// as in cuda_attention_test.cc) and must equal, bit for bit, the dense kernel run on that sequence
// alone with the same configuration. Fresh random
// inputs and lengths, odd and empty sequences, NaN-poisoned outputs with guard rows past the end.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "flashserve/kernels/float_convert.h"
#include "flashserve/kernels/reference_attention.h"
#include "gpu_test_util.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;

constexpr int kGuardRows = 5;  // poisoned rows after the packed q/o: must stay untouched

uint64_t fresh_seed() {
  static const uint64_t seed = [] {
    std::random_device rd;
    const uint64_t s = (uint64_t(rd()) << 32) ^ rd();
    std::printf("varlen_attention_test seed: %llu\n", static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(bytes, 16)), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct VarlenCase {
  std::string name;
  std::vector<int> len_q, len_k;  // empty len_k: same as len_q; empty both: random lengths
  int heads_q, heads_kv;
  bool causal;
};

std::vector<int> prefix_sums(const std::vector<int>& lens) {
  std::vector<int> cu(1, 0);
  for (int n : lens) cu.push_back(cu.back() + n);
  return cu;
}

double to_double(DType dtype, uint16_t x) {
  return dtype == DType::kFloat16 ? half_to_float(x) : bf16_to_float(x);
}

// max |x - ref| and ||x - ref|| / ||ref|| over one sequence.
void error_vs(const std::vector<double>& x, const std::vector<double>& ref, double* max_abs,
              double* rel_l2) {
  double num = 0, den = 0;
  *max_abs = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double d = x[i] - ref[i];
    *max_abs = std::max(*max_abs, std::abs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  *rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// The packed problem on the host and its device copies.
struct Packed {
  DType dtype;
  int head_dim, heads_q, heads_kv;
  std::vector<int> len_q, len_k, cu_q, cu_k;
  std::vector<uint16_t> q, k, v;
  int total_q = 0, total_k = 0, max_q = 0, max_k = 0;
};

Packed make_packed(DType dtype, int head_dim, const VarlenCase& c, std::mt19937_64& rng) {
  Packed pk{dtype, head_dim, c.heads_q, c.heads_kv, c.len_q, c.len_k.empty() ? c.len_q : c.len_k,
            {},    {},       {},        {},         {}};
  if (pk.len_q.empty()) {  // random: 7 sequences of 0..400 rows, keys 0..500
    std::uniform_int_distribution<int> lq(0, 400), lk(0, 500);
    for (int i = 0; i < 7; ++i) pk.len_q.push_back(lq(rng)), pk.len_k.push_back(lk(rng));
  }
  pk.cu_q = prefix_sums(pk.len_q);
  pk.cu_k = prefix_sums(pk.len_k);
  pk.total_q = pk.cu_q.back();
  pk.total_k = pk.cu_k.back();
  pk.max_q = *std::max_element(pk.len_q.begin(), pk.len_q.end());
  pk.max_k = *std::max_element(pk.len_k.begin(), pk.len_k.end());
  std::normal_distribution<float> normal(0.f, 1.f);
  auto random_tensor = [&](size_t n) {
    std::vector<uint16_t> t(n);
    for (auto& x : t)
      x = dtype == DType::kFloat16 ? float_to_half(normal(rng)) : float_to_bf16(normal(rng));
    return t;
  };
  pk.q = random_tensor(size_t(pk.total_q) * c.heads_q * head_dim);
  pk.k = random_tensor(size_t(pk.total_k) * c.heads_kv * head_dim);
  pk.v = random_tensor(size_t(pk.total_k) * c.heads_kv * head_dim);
  return pk;
}

// Sequence b alone as a dense batch-1 problem pointing into the packed host (or device) buffers.
AttentionParams sequence_params(const Packed& pk, int b, bool causal, const void* q, const void* k,
                                const void* v) {
  AttentionParams p =
      make_contiguous_params(pk.dtype, 1, pk.len_q[b], pk.len_k[b], pk.heads_q, pk.heads_kv,
                             pk.head_dim, causal, 1.f / std::sqrt(float(pk.head_dim)));
  const size_t q_row = size_t(pk.heads_q) * pk.head_dim, k_row = size_t(pk.heads_kv) * pk.head_dim;
  p.q = static_cast<const uint16_t*>(q) + pk.cu_q[b] * q_row;
  p.k = static_cast<const uint16_t*>(k) + pk.cu_k[b] * k_row;
  p.v = static_cast<const uint16_t*>(v) + pk.cu_k[b] * k_row;
  return p;
}

// The packed varlen problem on device buffers.
AttentionParams varlen_params(const Packed& pk, bool causal, const void* q, const void* k,
                              const void* v, void* o, float* lse, const int* cu_q,
                              const int* cu_k) {
  AttentionParams p =
      make_contiguous_params(pk.dtype, int(pk.len_q.size()), pk.max_q, pk.max_k, pk.heads_q,
                             pk.heads_kv, pk.head_dim, causal, 1.f / std::sqrt(float(pk.head_dim)));
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 0;  // ignored
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.total_q = pk.total_q;
  return p;
}

std::vector<fk::KernelConfig> sm80_candidates(DType dtype, int head_dim, bool causal) {
  std::vector<fk::KernelConfig> out;
  for (const fk::KernelConfig& cfg : fk::candidates(dtype, head_dim, causal))
    if (cfg.family == fk::KernelFamily::kSm80) out.push_back(cfg);
  return out;
}

// One sequence's fp64 reference and, per emulation options, the emulation's error against it.
struct SequenceReference {
  std::vector<double> out, lse;
  struct Emulated {
    reference::EmulationOptions options;
    double max_abs, rel_l2, lse_err;
  };
  std::vector<Emulated> emulated;

  const Emulated& emulated_for(const AttentionParams& host_p, const fk::KernelConfig& cfg) {
    reference::EmulationOptions options;
    options.block_n = cfg.block_n;
    options.backwards = true;
    options.rescale_threshold_log2 = cfg.rescale_threshold_log2();
    for (const Emulated& e : emulated)
      if (e.options.block_n == options.block_n &&
          e.options.rescale_threshold_log2 == options.rescale_threshold_log2)
        return e;
    std::vector<double> emu_out, emu_lse;
    reference::attention_emulated(host_p, options, &emu_out, &emu_lse);
    Emulated e{options, 0, 0, 0};
    error_vs(emu_out, out, &e.max_abs, &e.rel_l2);
    for (size_t i = 0; i < lse.size(); ++i)
      if (std::isfinite(lse[i])) e.lse_err = std::max(e.lse_err, std::abs(emu_lse[i] - lse[i]));
    emulated.push_back(e);
    return emulated.back();
  }
};

// Runs the dense kernel (batch 1) on sequence b of the packed device buffers with cfg.
void run_dense_sequence(const Packed& pk, int b, bool causal, const fk::KernelConfig& cfg,
                        const void* dq, const void* dk, const void* dv, std::vector<uint16_t>* o,
                        std::vector<float>* lse) {
  AttentionParams p = sequence_params(pk, b, causal, dq, dk, dv);
  const size_t o_elems = size_t(pk.len_q[b]) * pk.heads_q * pk.head_dim;
  DeviceBuffer dout(o_elems * 2), dlse(size_t(pk.heads_q) * pk.len_q[b] * 4);
  p.o = dout.ptr;
  p.lse = static_cast<float*>(dlse.ptr);
  ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o->resize(o_elems);
  lse->resize(size_t(pk.heads_q) * pk.len_q[b]);
  ASSERT_EQ(cudaMemcpy(o->data(), dout.ptr, o_elems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse->data(), dlse.ptr, lse->size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
}

// Checks sequence b of the varlen output (o, lse: the whole packed results) for one config.
void check_sequence(const Packed& pk, int b, bool causal, const fk::KernelConfig& cfg,
                    SequenceReference& ref, const std::vector<uint16_t>& o,
                    const std::vector<float>& lse, const void* dq, const void* dk, const void* dv) {
  SCOPED_TRACE("sequence " + std::to_string(b) + " (q " + std::to_string(pk.len_q[b]) + ", k " +
               std::to_string(pk.len_k[b]) + ")");
  const int len = pk.len_q[b];
  const size_t row = size_t(pk.heads_q) * pk.head_dim, first = pk.cu_q[b] * row;
  std::vector<double> got(len * row);
  for (size_t i = 0; i < got.size(); ++i) got[i] = to_double(pk.dtype, o[first + i]);
  for (double x : got) ASSERT_TRUE(std::isfinite(x)) << "NaN/Inf (or unwritten) output element";
  const AttentionParams host_p =
      sequence_params(pk, b, causal, pk.q.data(), pk.k.data(), pk.v.data());
  const SequenceReference::Emulated& emu = ref.emulated_for(host_p, cfg);
  double max_abs = 0, rel_l2 = 0;
  error_vs(got, ref.out, &max_abs, &rel_l2);
  EXPECT_LE(max_abs, 2 * emu.max_abs + 1e-6) << "emulated " << emu.max_abs;
  EXPECT_LE(rel_l2, 2 * emu.rel_l2 + 1e-6) << "emulated " << emu.rel_l2;
  std::vector<uint16_t> dense_o;
  std::vector<float> dense_lse;
  run_dense_sequence(pk, b, causal, cfg, dq, dk, dv, &dense_o, &dense_lse);
  EXPECT_TRUE(std::equal(dense_o.begin(), dense_o.end(), o.begin() + first))
      << "varlen O differs from the dense kernel on this sequence alone";
  for (int h = 0; h < pk.heads_q; ++h)
    for (int i = 0; i < len; ++i) {
      const float x = lse[size_t(h) * pk.total_q + pk.cu_q[b] + i];
      const double r = ref.lse[size_t(h) * len + i];
      ASSERT_EQ(std::memcmp(&x, &dense_lse[size_t(h) * len + i], 4), 0)
          << "LSE head " << h << " row " << i;
      if (std::isinf(r)) {
        ASSERT_TRUE(std::isinf(x) && x < 0) << "row sees no key: LSE must be -inf, got " << x;
      } else {
        ASSERT_LE(std::abs(x - r), 2 * emu.lse_err + 1e-4 + 4e-6 * std::abs(r))
            << "LSE head " << h << " row " << i;
      }
    }
}

// Runs every compiled sm80 configuration on one packed problem and checks every sequence.
void check_varlen(DType dtype, int head_dim, const VarlenCase& c) {
  std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name) ^ (uint64_t(head_dim) << 40) ^
                      uint64_t(dtype));
  const Packed pk = make_packed(dtype, head_dim, c, rng);
  const size_t q_row = size_t(c.heads_q) * head_dim;
  const size_t o_elems = (pk.total_q + kGuardRows) * q_row,
               lse_elems = size_t(c.heads_q) * pk.total_q;
  DeviceBuffer dq(pk.q.size() * 2), dk(pk.k.size() * 2), dv(pk.v.size() * 2), dout(o_elems * 2),
      dlse(lse_elems * 4 + 64), dcu_q(pk.cu_q.size() * 4), dcu_k(pk.cu_k.size() * 4);
  ASSERT_EQ(cudaMemcpy(dq.ptr, pk.q.data(), pk.q.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dk.ptr, pk.k.data(), pk.k.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dv.ptr, pk.v.data(), pk.v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dcu_q.ptr, pk.cu_q.data(), pk.cu_q.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dcu_k.ptr, pk.cu_k.data(), pk.cu_k.size() * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  const AttentionParams p =
      varlen_params(pk, c.causal, dq.ptr, dk.ptr, dv.ptr, dout.ptr, static_cast<float*>(dlse.ptr),
                    static_cast<const int*>(dcu_q.ptr), static_cast<const int*>(dcu_k.ptr));
  ASSERT_EQ(fk::supported(p), "");
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  ASSERT_EQ(fk::select(p, sm_count).family, fk::KernelFamily::kSm80);

  std::vector<SequenceReference> refs(pk.len_q.size());
  for (size_t b = 0; b < refs.size(); ++b)
    reference::attention_fp64(
        sequence_params(pk, int(b), c.causal, pk.q.data(), pk.k.data(), pk.v.data()), &refs[b].out,
        &refs[b].lse);
  // One sm80 configuration per (dtype, head_dim) has a variable-length kernel: select()'s.
  const fk::KernelConfig cfg = fk::select(p, sm_count);
  for (const fk::KernelConfig& other : sm80_candidates(dtype, head_dim, c.causal))
    if (other != cfg) {
      EXPECT_EQ(fk::run(p, other, nullptr), cudaErrorInvalidValue) << other.name();
    }
  std::vector<uint16_t> o(o_elems);
  std::vector<float> lse(lse_elems + 16);
  {
    SCOPED_TRACE("config " + cfg.name());
    ASSERT_EQ(cudaMemset(dout.ptr, 0xFF, o_elems * 2), cudaSuccess);  // NaN in fp16 and bf16
    ASSERT_EQ(cudaMemset(dlse.ptr, 0xFF, lse_elems * 4 + 64), cudaSuccess);
    ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(o.data(), dout.ptr, o_elems * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(lse.data(), dlse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = pk.total_q * q_row; i < o_elems; ++i)
      ASSERT_EQ(o[i], 0xFFFF) << "write past the last packed row (element " << i << ")";
    for (size_t i = lse_elems; i < lse.size(); ++i)
      ASSERT_TRUE(std::isnan(lse[i])) << "write past the packed LSE (entry " << i << ")";
    for (size_t b = 0; b < refs.size(); ++b)
      if (pk.len_q[b] > 0)
        check_sequence(pk, int(b), c.causal, cfg, refs[b], o, lse, dq.ptr, dk.ptr, dv.ptr);
  }
}

std::vector<VarlenCase> cases() {
  return {
      {"odd", {1, 17, 64, 65, 127, 300}, {}, 3, 3, false},
      {"odd_causal", {1, 17, 64, 65, 127, 300}, {}, 3, 3, true},
      {"empty_seqs", {0, 33, 0, 129, 0}, {5, 0, 7, 130, 0}, 2, 2, false},  // k 0: O 0, LSE -inf
      {"sq_ne_sk_causal", {5, 130, 1, 200}, {300, 17, 1025, 200}, 4, 2, true},
      {"gqa_8x2", {77, 250, 3}, {}, 8, 2, true},
      {"random", {}, {}, 4, 1, false},
      {"random_causal", {}, {}, 4, 1, true},
  };
}

struct Param {
  DType dtype;
  int head_dim;
  VarlenCase c;
};

std::vector<Param> all_params() {
  std::vector<Param> params;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16})
    for (int hd : {32, 64, 96, 128, 256})  // head dims not compiled in this build skip
      for (const VarlenCase& c : cases()) params.push_back({dtype, hd, c});
  return params;
}

class VarlenAttention : public ::testing::TestWithParam<Param> {};

TEST_P(VarlenAttention, EachSequenceMatchesFp64AndDense) {
  SKIP_WITHOUT_GPU();
  const Param& prm = GetParam();
  if (!testing_util::compiled(prm.dtype, prm.head_dim))
    GTEST_SKIP() << "head_dim " << prm.head_dim << " not compiled in this build";
  check_varlen(prm.dtype, prm.head_dim, prm.c);
}

INSTANTIATE_TEST_SUITE_P(Grid, VarlenAttention, ::testing::ValuesIn(all_params()),
                         [](const ::testing::TestParamInfo<Param>& param_info) {
                           const Param& prm = param_info.param;
                           return std::string(prm.dtype == DType::kFloat16 ? "fp16" : "bf16") +
                                  "_d" + std::to_string(prm.head_dim) + "_" + prm.c.name;
                         });

// A varlen problem with dummy (aligned) pointers for the checks that touch no GPU.
AttentionParams dummy_varlen() {
  static const int kCu[4] __attribute__((aligned(16))) = {0, 3, 5, 9};
  static const char kData[16] __attribute__((aligned(16))) = {};
  AttentionParams p = make_contiguous_params(fk::supported_dtypes().front(), 3, 4, 4, 2, 2,
                                             fk::supported_head_dims().front(), false, 0.1f);
  p.q = p.k = p.v = kData;
  p.o = const_cast<char*>(kData);
  p.cu_seqlens_q = p.cu_seqlens_k = kCu;
  p.total_q = 9;
  return p;
}

TEST(VarlenAttentionApi, SupportedNamesTheField) {
  AttentionParams p = dummy_varlen();
  EXPECT_EQ(fk::supported(p), "");
  p.cu_seqlens_k = nullptr;
  EXPECT_NE(fk::supported(p).find("cu_seqlens_q and cu_seqlens_k must both be set"),
            std::string::npos)
      << fk::supported(p);
  p = dummy_varlen();
  p.cu_seqlens_q = reinterpret_cast<const int*>(reinterpret_cast<const char*>(p.cu_seqlens_q) + 1);
  EXPECT_NE(fk::supported(p).find("4-byte aligned"), std::string::npos) << fk::supported(p);
  p = dummy_varlen();
  p.total_q = -1;
  EXPECT_NE(fk::supported(p).find("total_q must be >= 0"), std::string::npos) << fk::supported(p);
  p = dummy_varlen();
  static float lse[64];
  p.lse = lse;
  p.total_q = 0;
  EXPECT_NE(fk::supported(p).find("total_q (rows of the packed q) must be set"), std::string::npos)
      << fk::supported(p);
}

// sm90 configurations refuse packed inputs; run(p, stream) takes the sm80 family for them.
TEST(VarlenAttentionApi, Sm90ConfigsRefuseVarlen) {
  SKIP_WITHOUT_GPU();
  const AttentionParams p = dummy_varlen();
  for (const fk::KernelConfig& cfg : fk::candidates(p.dtype, p.head_dim, false))
    if (cfg.family == fk::KernelFamily::kSm90) {
      EXPECT_EQ(fk::run(p, cfg, nullptr), cudaErrorInvalidValue);
    }
  EXPECT_EQ(fk::select(p, 132).family, fk::KernelFamily::kSm80);
}

}  // namespace
}  // namespace flashserve::kernels
