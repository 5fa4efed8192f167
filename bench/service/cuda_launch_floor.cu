// The floor under the small request's "server overhead": the same CUDA calls the backend makes for
// one small request (stream-ordered alloc, events, 384 KiB H2D, a tiny kernel, 128 KiB D2H, free),
// timed from the host, without any server around them. Prints the median CPU cost of each call,
// the wall time from the first call until the last event is observed done, and the GPU time between
// the events -- their difference is launch/wake-up latency no server code can remove.
// Build and run on the GPU machine: nvcc -O2 -arch=sm_90 -o /tmp/floor cuda_launch_floor.cu && /tmp/floor
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <vector>
#include <algorithm>
using Clock = std::chrono::steady_clock;
__global__ void tiny(char* p) { if (threadIdx.x == 0) p[0] += 1; }
double us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
int main() {
  cudaSetDevice(0); cudaFree(0);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t ev[5]; for (int i = 0; i < 5; ++i) cudaEventCreateWithFlags(&ev[i], i == 4 ? cudaEventBlockingSync | cudaEventDisableTiming : 0);
  const size_t total = 640 << 10; char* host; cudaHostAlloc(&host, total, cudaHostAllocPortable);
  uint64_t thr = 4ull << 30; cudaMemPool_t pool; cudaDeviceGetDefaultMemPool(&pool, 0); cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
  std::vector<double> t_set, t_malloc, t_rec, t_h2d, t_kern, t_d2h, t_free, t_wait, t_elapsed, t_total, gpu;
  for (int it = 0; it < 3000; ++it) {
    auto a = Clock::now(); cudaSetDevice(0); auto b = Clock::now();
    char* d; cudaMallocAsync((void**)&d, total, s); auto c = Clock::now();
    cudaEventRecord(ev[0], s); auto e = Clock::now();
    cudaMemcpyAsync(d, host, 384 << 10, cudaMemcpyHostToDevice, s); auto f = Clock::now();
    cudaEventRecord(ev[1], s); tiny<<<132, 128, 0, s>>>(d); cudaEventRecord(ev[2], s); auto g = Clock::now();
    cudaMemcpyAsync(host + (384 << 10), d + (384 << 10), 128 << 10, cudaMemcpyDeviceToHost, s); auto h = Clock::now();
    cudaEventRecord(ev[3], s); cudaEventRecord(ev[4], s); cudaFreeAsync(d, s); auto i = Clock::now();
    while (cudaEventQuery(ev[3]) == cudaErrorNotReady) {} auto j = Clock::now();
    float ms0, ms1, ms2; cudaEventElapsedTime(&ms0, ev[0], ev[1]); cudaEventElapsedTime(&ms1, ev[1], ev[2]); cudaEventElapsedTime(&ms2, ev[2], ev[3]); auto k = Clock::now();
    if (it < 100) continue;
    t_set.push_back(us(a, b)); t_malloc.push_back(us(b, c)); t_rec.push_back(us(c, e)); t_h2d.push_back(us(e, f)); t_kern.push_back(us(f, g));
    t_d2h.push_back(us(g, h)); t_free.push_back(us(h, i)); t_wait.push_back(us(i, j)); t_elapsed.push_back(us(j, k)); t_total.push_back(us(a, j));
    gpu.push_back((ms0 + ms1 + ms2) * 1000);
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  printf("median us: setdevice %.1f malloc %.1f record %.1f h2d-call %.1f event+kernel+event %.1f d2h-call %.1f events+free %.1f wait-after-launch %.1f elapsed x3 %.1f | total launch->done %.1f gpu(e0..e3) %.1f\n",
         med(t_set), med(t_malloc), med(t_rec), med(t_h2d), med(t_kern), med(t_d2h), med(t_free), med(t_wait), med(t_elapsed), med(t_total), med(gpu));
  return 0;
}
