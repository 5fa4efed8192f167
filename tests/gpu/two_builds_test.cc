// Two copies of the kernels' C library in one process (an A/B benchmark loads two builds side by
// side, each dlopen'ed RTLD_LOCAL): each copy must raise its own kernels' shared-memory limit.
// Before kernels/cuda/smem_limit.h, the "already raised" flags were function-local statics in
// templates, which glibc shares process-wide (STB_GNU_UNIQUE): the second copy's launches of
// every configuration over 48 KB of shared memory failed with cudaErrorInvalidValue.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "flashserve/kernels/attention_params.h"
#include "gpu_test_support.h"

namespace {

namespace fs = std::filesystem;
namespace tu = flashserve::kernels::testing_util;
using flashserve::kernels::AttentionParams;
using flashserve::kernels::DType;

using ForwardFn = int (*)(int, const void*, const void*, const void*, void*, float*, int, int, int,
                          int, int, int, const int64_t*, float, int, const char*, void*);

// The library under test: this build's, or FLASHSERVE_CAPI_LIB_UNDER_TEST (e.g. an older build,
// to see the test fail there).
fs::path library_under_test() {
  const char* other = std::getenv("FLASHSERVE_CAPI_LIB_UNDER_TEST");
  return other != nullptr && other[0] != '\0' ? fs::path(other) : fs::path(FLASHSERVE_CAPI_LIB);
}

// A private copy of the library (a distinct file, so dlopen maps it a second time).
struct LoadedCopy {
  void* handle = nullptr;
  ForwardFn forward = nullptr;
  ~LoadedCopy() {
    if (handle != nullptr) dlclose(handle);
  }
};

void load_copy(const fs::path& dir, const std::string& name, LoadedCopy* copy) {
  const fs::path file = dir / name;
  fs::copy_file(library_under_test(), file, fs::copy_options::overwrite_existing);
  copy->handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(copy->handle, nullptr) << dlerror();
  copy->forward = reinterpret_cast<ForwardFn>(dlsym(copy->handle, "flashserve_attention_forward"));
  ASSERT_NE(copy->forward, nullptr) << dlerror();
}

// Runs config on p's buffers (NaN-poisoned O first): the call's cudaError_t, and O.
int run(const LoadedCopy& copy, const AttentionParams& p, tu::DeviceProblem& dev,
        const char* config, std::vector<uint16_t>* out) {
  if (dev.poison() != cudaSuccess) return -1;
  const int64_t strides[12] = {p.q_batch_stride, p.q_row_stride, p.q_head_stride,
                               p.k_batch_stride, p.k_row_stride, p.k_head_stride,
                               p.v_batch_stride, p.v_row_stride, p.v_head_stride,
                               p.o_batch_stride, p.o_row_stride, p.o_head_stride};
  const int rc = copy.forward(int(p.dtype), dev.q.get(), dev.k.get(), dev.v.get(), dev.o.get(),
                              nullptr, p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv,
                              p.head_dim, strides, p.softmax_scale, int(p.causal), config,
                              nullptr);
  if (rc != 0) return rc;
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) return err;
  out->resize(tu::q_elements(p));
  return dev.o.download(out);
}

TEST(TwoBuildsInOneProcess, EachRaisesItsOwnSharedMemoryLimit) {
  SKIP_WITHOUT_GPU();
  const fs::path dir = fs::temp_directory_path() /
                       ("flashserve-two-builds-" + std::to_string(std::random_device{}()));
  fs::create_directories(dir);
  {
    LoadedCopy a, b;
    ASSERT_NO_FATAL_FAILURE(load_copy(dir, "a.so", &a));
    ASSERT_NO_FATAL_FAILURE(load_copy(dir, "b.so", &b));
    AttentionParams hp = flashserve::kernels::make_contiguous_params(
        DType::kBFloat16, 1, 257, 257, 2, 2, 128, true, 1.f / std::sqrt(128.f));
    std::mt19937_64 rng(tu::case_seed("two_builds"));
    const tu::HostQkv qkv = tu::random_qkv(&hp, 1.f, rng);
    tu::DeviceProblem dev(hp);
    ASSERT_EQ(dev.upload(hp), cudaSuccess);
    const AttentionParams p = dev.params(hp, false);
    // Both need more than 48 KB of shared memory: the sm80 family's d128 128x64 two-stage
    // configuration (sm_80 and later) and, on sm_90, the sm90 family's default.
    for (const char* config : {"m128n64w4s2", "sm90m128n128w12s2l"}) {
      SCOPED_TRACE(config);
      std::vector<uint16_t> out_a, out_b;
      const int rc_a = run(a, p, dev, config, &out_a);
      if (rc_a == cudaErrorInvalidValue && config[0] == 's') continue;  // no sm90 on this GPU
      ASSERT_EQ(rc_a, 0);
      ASSERT_EQ(run(b, p, dev, config, &out_b), 0) << "the second copy's launch failed";
      EXPECT_TRUE(tu::all_finite(tu::to_double(hp.dtype, out_b)));
      EXPECT_TRUE(out_a == out_b) << "one build, two answers";
    }
  }
  fs::remove_all(dir);
}

}  // namespace
