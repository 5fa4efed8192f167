// The floor under the small request's "server overhead": the CUDA work the backend queues for one
// small request (384 KiB H2D, a tiny kernel, 128 KiB D2H, timing events), timed from the host with
// no server around it. Three ways to queue it -- separate calls (stream-ordered alloc, events, copies,
// launch, free), one launch of a CUDA graph holding the same work, and the same graph with its copy
// and kernel nodes pointed at this request's buffers before the launch -- and three ways to spend the
// time between requests: none (back to back), spinning on the CPU, and sleeping (as a server
// thread waiting for its next request does). Also times the one host copy of the request (384 KiB
// from ordinary memory into pinned memory) in each of those conditions.
// Build and run on the GPU machine: nvcc -O2 -std=c++20 -arch=sm_90 -o /tmp/floor cuda_launch_floor.cu && /tmp/floor
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "probe_util.cuh"

constexpr size_t kIn = 384 << 10, kOut = 128 << 10, kTotal = kIn + kOut;

enum class Gap { kNone, kSpin, kSleep };
static void Wait(Gap g) {
  if (g == Gap::kSpin) {
    const auto end = Clock::now() + std::chrono::microseconds(400);
    while (Clock::now() < end) {
    }
  } else if (g == Gap::kSleep) {
    std::this_thread::sleep_for(std::chrono::microseconds(400));
  }
}

int main() {
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t ev[4];
  for (auto& e : ev) CHECK(cudaEventCreate(&e));
  char* host;
  CHECK(cudaHostAlloc(&host, kTotal, cudaHostAllocPortable));
  std::vector<char> request(kIn, 1);  // the receive buffer: ordinary memory
  uint64_t threshold = 4ull << 30;
  cudaMemPool_t pool;
  CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
  CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

  // The graph: the same copies, kernel and events on a fixed device buffer.
  char* fixed;
  CHECK(cudaMalloc(&fixed, kTotal));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CHECK(cudaEventRecordWithFlags(ev[0], s, cudaEventRecordExternal));
  CHECK(cudaMemcpyAsync(fixed, host, kIn, cudaMemcpyHostToDevice, s));
  CHECK(cudaEventRecordWithFlags(ev[1], s, cudaEventRecordExternal));
  tiny<<<132, 128, 0, s>>>(fixed);
  CHECK(cudaEventRecordWithFlags(ev[2], s, cudaEventRecordExternal));
  CHECK(cudaMemcpyAsync(host + kIn, fixed + kIn, kOut, cudaMemcpyDeviceToHost, s));
  CHECK(cudaEventRecordWithFlags(ev[3], s, cudaEventRecordExternal));
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // The nodes to re-point per request (graph+update): the two copies and the kernel.
  size_t count = 0;
  CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  cudaGraphNode_t h2d_node = nullptr, d2h_node = nullptr, kernel_node = nullptr;
  for (cudaGraphNode_t n : nodes) {
    cudaGraphNodeType type;
    CHECK(cudaGraphNodeGetType(n, &type));
    if (type == cudaGraphNodeTypeKernel) kernel_node = n;
    if (type == cudaGraphNodeTypeMemcpy) {
      cudaMemcpy3DParms copy{};
      CHECK(cudaGraphMemcpyNodeGetParams(n, &copy));
      (copy.dstPtr.ptr == fixed ? h2d_node : d2h_node) = n;
    }
  }
  cudaKernelNodeParams kernel_params{};
  CHECK(cudaGraphKernelNodeGetParams(kernel_node, &kernel_params));
  char* fixed2;
  CHECK(cudaMalloc(&fixed2, kTotal));
  char* host2;
  CHECK(cudaHostAlloc(&host2, kTotal, cudaHostAllocPortable));

  // One request of the given mode; false on a CUDA error.
  auto run_one = [&](int mode, int it, double out[4]) {
    const auto a = Clock::now();
    std::memcpy(host, request.data(), kIn);
    const auto b = Clock::now();
    if (mode == 2) {  // alternate between two buffer pairs, as requests would
      char* dev = (it & 1) ? fixed2 : fixed;
      char* pinned = (it & 1) ? host2 : host;
      void* args[] = {&dev};
      cudaKernelNodeParams kp = kernel_params;
      kp.kernelParams = args;
      if (cudaGraphExecMemcpyNodeSetParams1D(exec, h2d_node, dev, pinned, kIn,
                                             cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaGraphExecKernelNodeSetParams(exec, kernel_node, &kp) != cudaSuccess ||
          cudaGraphExecMemcpyNodeSetParams1D(exec, d2h_node, pinned + kIn, dev + kIn, kOut,
                                             cudaMemcpyDeviceToHost) != cudaSuccess ||
          cudaGraphLaunch(exec, s) != cudaSuccess) {
        return false;
      }
    } else if (mode == 1) {
      if (cudaGraphLaunch(exec, s) != cudaSuccess) return false;
    } else {
      char* d;
      cudaMallocAsync(reinterpret_cast<void**>(&d), kTotal, s);
      cudaEventRecord(ev[0], s);
      cudaMemcpyAsync(d, host, kIn, cudaMemcpyHostToDevice, s);
      cudaEventRecord(ev[1], s);
      tiny<<<132, 128, 0, s>>>(d);
      cudaEventRecord(ev[2], s);
      cudaMemcpyAsync(host + kIn, d + kIn, kOut, cudaMemcpyDeviceToHost, s);
      cudaEventRecord(ev[3], s);
      cudaFreeAsync(d, s);
    }
    const auto c = Clock::now();
    while (cudaEventQuery(ev[3]) == cudaErrorNotReady) {
    }
    const auto d = Clock::now();
    float ms[3] = {};
    for (int i = 0; i < 3; ++i) cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]);
    out[0] = us(a, b);
    out[1] = us(b, c);
    out[2] = us(b, d);
    out[3] = (ms[0] + ms[1] + ms[2]) * 1000.0;
    return cudaGetLastError() == cudaSuccess;
  };
  constexpr int kRequests = 2200, kWarmup = 200, kThreads = 8;
  std::printf("median us over %d requests (after %d warm-up): stage = 384 KiB memcpy into pinned "
              "memory; submit = host time queueing the work; done = submit start -> last event "
              "seen; gpu = event span; floor = done - gpu\n", kRequests - kWarmup, kWarmup);
  const char* mode_names[] = {"calls", "graph", "graph+update"};
  const char* gap_names[] = {"back-to-back", "spin 400us", "sleep 400us",
                             "8 threads taking turns, 400us sleep"};
  for (int mode = 0; mode < 3; ++mode) {
    for (int gap = 0; gap < 4; ++gap) {
      std::vector<std::array<double, 4>> samples(kRequests);
      bool ok = true;
      if (gap < 3) {
        for (int it = 0; it < kRequests && ok; ++it) {
          Wait(Gap(gap));
          ok = run_one(mode, it, samples[it].data());
        }
      } else {
        // Each request on the next of 8 threads, which slept in between: what a server whose
        // requests land on whichever of its threads is free does.
        std::atomic<int> turn{0};
        std::atomic<bool> failed{false};
        std::vector<std::thread> pool;
        for (int t = 0; t < kThreads; ++t) {
          pool.emplace_back([&, t] {
            cudaSetDevice(0);
            for (int it = t; it < kRequests; it += kThreads) {
              for (int now = turn.load(); now != it; now = turn.load()) turn.wait(now);
              if (!run_one(mode, it, samples[it].data())) failed = true;
              std::this_thread::sleep_for(std::chrono::microseconds(400));
              turn.store(it + 1);
              turn.notify_all();
            }
          });
        }
        for (auto& th : pool) th.join();
        ok = !failed;
      }
      if (!ok) {
        std::fprintf(stderr, "%s: CUDA error %s\n", mode_names[mode],
                     cudaGetErrorString(cudaGetLastError()));
        return 1;
      }
      std::vector<double> col[4];
      for (int it = kWarmup; it < kRequests; ++it) {
        for (int k = 0; k < 4; ++k) col[k].push_back(samples[it][k]);
      }
      std::printf("%-12s %-36s stage %6.1f  submit %6.1f  done %6.1f  gpu %6.1f  floor %6.1f\n",
                  mode_names[mode], gap_names[gap], median(col[0]), median(col[1]),
                  median(col[2]), median(col[3]), median(col[2]) - median(col[3]));
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
