// Variable-length prefill (AttentionParams::cu_seqlens_q/k): many sequences of different lengths
// packed into one q/k/v/o, run in one launch by every configuration that takes packed inputs (the
// sm80 configuration with a variable-length kernel, the others must refuse; on an sm_90 GPU every
// sm90 configuration, given total_k). Each sequence is checked against a
// plain fp64 reference of that sequence alone (tolerance: 2x the error of the config's emulation,
// as in cuda_attention_test.cc) and must equal, bit for bit, the dense kernel run on that sequence
// alone with the same configuration. Fresh random
// inputs and lengths, odd and empty sequences, NaN-poisoned outputs with guard rows past the end.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "flashserve/kernels/cuda_attention.h"
#include "gpu_test_support.h"

namespace flashserve::kernels {
namespace {

namespace fk = cuda;
namespace tu = testing_util;

constexpr int kGuardRows = 5;  // poisoned rows after the packed q/o: must stay untouched

struct VarlenCase {
  std::string name;
  std::vector<int> len_q, len_k;  // empty len_k: same as len_q; empty both: random lengths
  int heads_q, heads_kv;
  bool causal;
  // Every sequence after the first is all NaN (q, k, v): the first, whose last K/V tile is cut
  // short by them, must not see them. Only the first is checked.
  bool nan_neighbours = false;
};

std::vector<int> prefix_sums(const std::vector<int>& lens) {
  std::vector<int> cu(1, 0);
  for (int n : lens) cu.push_back(cu.back() + n);
  return cu;
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
  pk.q = tu::random_tensor(dtype, size_t(pk.total_q) * c.heads_q * head_dim, 1.f, rng);
  pk.k = tu::random_tensor(dtype, size_t(pk.total_k) * c.heads_kv * head_dim, 1.f, rng);
  pk.v = tu::random_tensor(dtype, size_t(pk.total_k) * c.heads_kv * head_dim, 1.f, rng);
  if (c.nan_neighbours) {  // 0xFFFF is a NaN in fp16 and bf16
    std::fill(pk.q.begin() + size_t(pk.cu_q[1]) * c.heads_q * head_dim, pk.q.end(), 0xFFFF);
    std::fill(pk.k.begin() + size_t(pk.cu_k[1]) * c.heads_kv * head_dim, pk.k.end(), 0xFFFF);
    std::fill(pk.v.begin() + size_t(pk.cu_k[1]) * c.heads_kv * head_dim, pk.v.end(), 0xFFFF);
  }
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
  p.total_k = pk.total_k;
  return p;
}

// Runs the dense kernel (batch 1) on sequence b of the packed device buffers with cfg.
void run_dense_sequence(const Packed& pk, int b, bool causal, const fk::KernelConfig& cfg,
                        const void* dq, const void* dk, const void* dv, std::vector<uint16_t>* o,
                        std::vector<float>* lse) {
  AttentionParams p = sequence_params(pk, b, causal, dq, dk, dv);
  o->resize(size_t(pk.len_q[b]) * pk.heads_q * pk.head_dim);
  lse->resize(size_t(pk.heads_q) * pk.len_q[b]);
  tu::DeviceBuffer dout(o->size() * 2), dlse(lse->size() * 4);
  p.o = dout.get();
  p.lse = dlse.as<float>();
  ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(dout.download(o), cudaSuccess);
  ASSERT_EQ(dlse.download(lse), cudaSuccess);
}

// Sequence b's rows of the packed LSE [heads_q, total_q], as [heads_q, len_q[b]].
std::vector<float> sequence_lse(const Packed& pk, int b, const std::vector<float>& lse) {
  const int len = pk.len_q[b];
  std::vector<float> out(size_t(pk.heads_q) * len);
  for (int h = 0; h < pk.heads_q; ++h)
    for (int i = 0; i < len; ++i)
      out[size_t(h) * len + i] = lse[size_t(h) * pk.total_q + pk.cu_q[b] + i];
  return out;
}

// Index of the first LSE entry whose bits differ, or -1.
long first_bit_difference(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return long(i);
  return -1;
}

// Checks sequence b of the varlen output (o, lse: the whole packed results) for one config.
void check_sequence(const Packed& pk, int b, bool causal, const fk::KernelConfig& cfg,
                    tu::Fp64Reference& ref, const std::vector<uint16_t>& o,
                    const std::vector<float>& lse, const void* dq, const void* dk, const void* dv) {
  SCOPED_TRACE("sequence " + std::to_string(b) + " (q " + std::to_string(pk.len_q[b]) + ", k " +
               std::to_string(pk.len_k[b]) + ")");
  const size_t row = size_t(pk.heads_q) * pk.head_dim, first = pk.cu_q[b] * row;
  const std::vector<uint16_t> seq_o(o.begin() + first, o.begin() + first + pk.len_q[b] * row);
  const std::vector<double> got = tu::to_double(pk.dtype, seq_o);
  ASSERT_TRUE(tu::all_finite(got));
  const tu::EmulatedError& emu = ref.emulated(cfg);
  EXPECT_TRUE(tu::within_twice_emulated(tu::error_vs(got, ref.out()), emu.out));
  std::vector<uint16_t> dense_o;
  std::vector<float> dense_lse;
  ASSERT_NO_FATAL_FAILURE(run_dense_sequence(pk, b, causal, cfg, dq, dk, dv, &dense_o, &dense_lse));
  EXPECT_TRUE(dense_o == seq_o) << "varlen O differs from the dense kernel on this sequence alone";
  const std::vector<float> seq_lse = sequence_lse(pk, b, lse);
  ASSERT_EQ(first_bit_difference(seq_lse, dense_lse), -1)
      << "varlen LSE differs from the dense kernel's (index: head * len_q + row)";
  ASSERT_TRUE(tu::lse_matches(seq_lse, ref.lse(), emu.lse));
}

// The packed problem's device buffers: Q/K/V, O with guard rows, LSE with guard entries,
// cu_seqlens.
struct DevicePacked {
  explicit DevicePacked(const Packed& pk)
      : q(pk.q.size() * 2),
        k(pk.k.size() * 2),
        v(pk.v.size() * 2),
        o((size_t(pk.total_q) + kGuardRows) * pk.heads_q * pk.head_dim * 2),
        lse(size_t(pk.heads_q) * pk.total_q * 4 + 64),
        cu_q(pk.cu_q.size() * 4),
        cu_k(pk.cu_k.size() * 4) {}
  cudaError_t upload(const Packed& pk) {
    for (cudaError_t e : {q.upload(pk.q), k.upload(pk.k), v.upload(pk.v), cu_q.upload(pk.cu_q),
                          cu_k.upload(pk.cu_k)})
      if (e != cudaSuccess) return e;
    return cudaSuccess;
  }
  tu::DeviceBuffer q, k, v, o, lse, cu_q, cu_k;
};

// The guard rows after the packed O and the guard entries after the LSE must stay poisoned.
void expect_guards_untouched(const Packed& pk, const std::vector<uint16_t>& o,
                             const std::vector<float>& lse) {
  const size_t lse_elems = size_t(pk.heads_q) * pk.total_q;
  for (size_t i = size_t(pk.total_q) * pk.heads_q * pk.head_dim; i < o.size(); ++i)
    ASSERT_EQ(o[i], 0xFFFF) << "write past the last packed row (element " << i << ")";
  for (size_t i = lse_elems; i < lse.size(); ++i)
    ASSERT_TRUE(std::isnan(lse[i])) << "write past the packed LSE (entry " << i << ")";
}

// Runs cfg on the packed problem p (NaN-poisoned O and LSE) and checks every sequence (only the
// first with nan_neighbours) and the guard rows.
void check_config(const Packed& pk, const VarlenCase& c, const AttentionParams& p,
                  const fk::KernelConfig& cfg, DevicePacked& dev,
                  std::vector<tu::Fp64Reference>& refs) {
  SCOPED_TRACE("config " + cfg.name());
  ASSERT_EQ(dev.o.poison(), cudaSuccess);
  ASSERT_EQ(dev.lse.poison(), cudaSuccess);
  ASSERT_EQ(fk::run(p, cfg, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> o((size_t(pk.total_q) + kGuardRows) * pk.heads_q * pk.head_dim);
  std::vector<float> lse(size_t(pk.heads_q) * pk.total_q + 16);
  ASSERT_EQ(dev.o.download(&o), cudaSuccess);
  ASSERT_EQ(dev.lse.download(&lse), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(expect_guards_untouched(pk, o, lse));
  const size_t checked = c.nan_neighbours ? 1 : refs.size();
  for (size_t b = 0; b < checked; ++b)
    if (pk.len_q[b] > 0) {
      check_sequence(pk, int(b), c.causal, cfg, refs[b], o, lse, dev.q.get(), dev.k.get(),
                     dev.v.get());
    }
}

// Runs every configuration that takes packed inputs on one packed problem: the sm80 one with a
// variable-length kernel (select()'s without total_k; the other sm80 configurations must refuse)
// and, on an sm_90 GPU, every sm90 configuration (select()'s choice there with total_k).
void check_varlen(DType dtype, int head_dim, const VarlenCase& c) {
  std::mt19937_64 rng(tu::case_seed(std::string(dtype == DType::kFloat16 ? "fp16" : "bf16") + "_d" +
                                    std::to_string(head_dim) + "_" + c.name));
  const Packed pk = make_packed(dtype, head_dim, c, rng);
  DevicePacked dev(pk);
  ASSERT_EQ(dev.upload(pk), cudaSuccess);
  const AttentionParams p =
      varlen_params(pk, c.causal, dev.q.get(), dev.k.get(), dev.v.get(), dev.o.get(),
                    dev.lse.as<float>(), dev.cu_q.as<const int>(), dev.cu_k.as<const int>());
  ASSERT_EQ(fk::supported(p), "");
  int sm_count = 0;
  ASSERT_EQ(tu::multiprocessor_count(&sm_count), cudaSuccess);
  AttentionParams p_no_total_k = p;
  p_no_total_k.total_k = 0;  // sm90 cannot size its tensor maps: the sm80 family runs it
  const fk::KernelConfig cfg80 = fk::select(p_no_total_k, sm_count);
  ASSERT_EQ(cfg80.family, fk::KernelFamily::kSm80);
  std::vector<fk::KernelConfig> configs{cfg80};
  for (const fk::KernelConfig& cfg : fk::candidates(dtype, head_dim, c.causal)) {
    if (cfg.family == fk::KernelFamily::kSm90) {
      configs.push_back(cfg);
      EXPECT_EQ(fk::run(p_no_total_k, cfg, nullptr), cudaErrorInvalidValue) << cfg.name();
    } else if (cfg != cfg80) {
      EXPECT_EQ(fk::run(p, cfg, nullptr), cudaErrorInvalidValue) << cfg.name();
    }
  }
  std::vector<tu::Fp64Reference> refs;  // point into pk's host tensors
  for (size_t b = 0; b < pk.len_q.size(); ++b)
    refs.emplace_back(sequence_params(pk, int(b), c.causal, pk.q.data(), pk.k.data(), pk.v.data()));
  for (const fk::KernelConfig& cfg : configs)
    ASSERT_NO_FATAL_FAILURE(check_config(pk, c, p, cfg, dev, refs));
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
      // The first sequence ends mid-tile (70 keys: 128- and 176-key tiles, 64-key tiles at
      // d256), its neighbours are NaN; with and without causal, and with a short one (9 keys).
      {"nan_neighbours", {70, 50}, {70, 60}, 2, 1, false, true},
      {"nan_neighbours_causal", {70, 50}, {70, 60}, 2, 1, true, true},
      {"nan_neighbours_short", {9, 50, 3}, {9, 60, 200}, 2, 2, false, true},
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
  if (!tu::compiled(prm.dtype, prm.head_dim))
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

// Without total_k sm90 configurations refuse packed inputs and select() takes the sm80 family;
// with it select() takes the sm90 family wherever it has configurations (an sm_90 GPU).
TEST(VarlenAttentionApi, Sm90NeedsTotalKAndTotalQ) {
  SKIP_WITHOUT_GPU();
  AttentionParams p = dummy_varlen();
  bool has_sm90 = false;
  for (const fk::KernelConfig& cfg : fk::candidates(p.dtype, p.head_dim, false))
    if (cfg.family == fk::KernelFamily::kSm90) {
      has_sm90 = true;
      EXPECT_EQ(fk::run(p, cfg, nullptr), cudaErrorInvalidValue);
    }
  // sm_count 1: the problem is then large enough for sm90 (sm90_worth_it).
  EXPECT_EQ(fk::select(p, 1).family, fk::KernelFamily::kSm80);
  p.total_k = 9;
  EXPECT_EQ(fk::select(p, 1).family, has_sm90 ? fk::KernelFamily::kSm90 : fk::KernelFamily::kSm80);
  // total_q may be 0 without LSE (lse is null here), but the sm90 Q and O tensor maps need it:
  // they were built empty and the kernel loaded and stored through them.
  p.total_q = 0;
  EXPECT_EQ(fk::supported(p), "");
  EXPECT_EQ(fk::select(p, 1).family, fk::KernelFamily::kSm80);
  for (const fk::KernelConfig& cfg : fk::candidates(p.dtype, p.head_dim, false)) {
    if (cfg.family == fk::KernelFamily::kSm90) {
      EXPECT_EQ(fk::run(p, cfg, nullptr), cudaErrorInvalidValue);
    }
  }
  p.total_k = -1;
  EXPECT_NE(fk::supported(p).find("total_k must be >= 0"), std::string::npos) << fk::supported(p);
}

}  // namespace
}  // namespace flashserve::kernels
