// What the CUDA runtime does that the server's CUDA code relies on, checked on the GPU it runs on.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstddef>

#include "gpu_test_support.h"

namespace flashserve::kernels {
namespace {

// The attention backend's completion thread polls cudaEventQuery (runtime/cuda_backend_jobs.cc)
// and the KV scatter launch reads cudaGetLastError (runtime/kv_scatter.cu): a cudaErrorNotReady
// answer must not stay behind as the thread's last error, or a later successful launch on that
// thread would read as a failure. (kernels/cuda/counter_slots.cc queries through cuEventQuery
// on the assumption that it would.)
TEST(CudaRuntimeFacts, EventQueryNotReadyIsNotLeftAsTheLastError) {
  SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = size_t{1} << 30;
  void* buffer = nullptr;
  ASSERT_EQ(cudaMalloc(&buffer, kBytes), cudaSuccess);
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // Milliseconds of work ahead of the event (a 1 GiB memset is >= 0.2 ms on any GPU; 20 of them).
  for (int i = 0; i < 20; ++i) ASSERT_EQ(cudaMemsetAsync(buffer, i, kBytes, stream), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(done, stream), cudaSuccess);
  const cudaError_t queried = cudaEventQuery(done);
  const cudaError_t last = cudaGetLastError();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaEventDestroy(done);
  cudaStreamDestroy(stream);
  cudaFree(buffer);
  if (queried == cudaSuccess) GTEST_SKIP() << "the work had ended before the query";
  ASSERT_EQ(queried, cudaErrorNotReady);
  EXPECT_EQ(last, cudaSuccess) << "cudaErrorNotReady became the thread's last error: "
                               << cudaGetErrorName(last);
}

}  // namespace
}  // namespace flashserve::kernels
