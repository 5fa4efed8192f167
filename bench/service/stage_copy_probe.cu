// What the one host copy of a request (gRPC's receive buffer -> pinned staging) costs, and what
// else could move the bytes to the device. Three parts:
//  1. the small request's copy (3 x 128 KiB) on a "lane" thread, with the source written just
//     before by the same thread, by another thread (as gRPC's poller writes a receive buffer), or
//     into a fresh mmap by another thread; copied with glibc's memcpy, with non-temporal stores,
//     or with `rep movsb`;
//  2. the whole small request (copy + H2D + tiny kernel + D2H, polled to completion): staged into
//     pinned memory, or H2D straight from the pageable source (the driver stages it), or staged
//     piece by piece with each piece's H2D queued right after its copy;
//  3. many threads each copying a medium request (48 MiB in 4 MiB pieces) into pinned memory at
//     once, glibc vs non-temporal stores: aggregate GB/s (memory bandwidth under concurrency);
//  4. the small request's copy split over the lane and a few helper threads spinning for work;
//  5. a medium request's bytes to the device through a pinned copy, or registered in place
//     (cudaHostRegister), wall and CPU time;
//  6. a medium request already in page-locked memory as gRPC's 64 KiB read buffers (the receive
//     arena) to the device: one batch copy, one copy per piece, or a gather kernel.
// Build and run on the GPU machine:
//   nvcc -O2 -std=c++20 -arch=sm_90 -o /tmp/stage stage_copy_probe.cu && /tmp/stage
#include <cuda_runtime.h>
#include <emmintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "probe_util.cuh"

// Non-temporal: the destination lines are written without being read first (no read-for-ownership)
// and without displacing the cache.
static void CopyStream(char* dest, const char* src, size_t n) {
  const size_t head = std::min(n, size_t((16 - (uintptr_t(dest) & 15)) & 15));
  std::memcpy(dest, src, head);
  dest += head, src += head, n -= head;
  for (; n >= 64; n -= 64, dest += 64, src += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dest), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dest + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dest + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dest + 48), d);
  }
  std::memcpy(dest, src, n);
  _mm_sfence();
}
static void CopyRepMovsb(char* dest, const char* src, size_t n) {
  asm volatile("rep movsb" : "+D"(dest), "+S"(src), "+c"(n) : : "memory");
}
using CopyFn = void (*)(char*, const char*, size_t);
static void CopyGlibc(char* dest, const char* src, size_t n) { std::memcpy(dest, src, n); }

constexpr size_t kPiece = 128 << 10, kPieces = 3, kIn = kPiece * kPieces, kOut = 128 << 10;
constexpr int kReps = 2200, kWarmup = 200;

// Runs `fn(it)` on one fixed thread kReps times, `writer(it)` on another thread just before each
// (or on the same thread when same_thread), with a sleep between requests as a server has.
static std::vector<double> OnLane(const std::function<void(int)>& writer, bool same_thread,
                                  const std::function<double(int)>& fn) {
  std::vector<double> samples;
  std::atomic<int> written{-1};
  std::atomic<bool> stop{false};
  std::thread other;
  if (!same_thread) {
    other = std::thread([&] {
      cudaSetDevice(0);
      for (int it = 0; it < kReps; ++it) {
        writer(it);
        written.store(it);
        written.notify_one();
        while (written.load() == it && !stop.load()) std::this_thread::yield();
      }
    });
  }
  std::thread lane([&] {
    cudaSetDevice(0);
    for (int it = 0; it < kReps; ++it) {
      if (same_thread) {
        writer(it);
      } else {
        for (int now = written.load(); now != it; now = written.load()) written.wait(now);
      }
      const double t = fn(it);
      if (it >= kWarmup) samples.push_back(t);
      if (!same_thread) written.store(-2);  // lets the writer go on
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  lane.join();
  stop = true;
  if (other.joinable()) other.join();
  return samples;
}

// Section 6: copy kernels that read page-locked host memory directly (one block per piece).
constexpr int kGatherMax = 1024;
struct GatherTable {
  int n;
  const char* src[kGatherMax];
  char* dst[kGatherMax];
  uint32_t bytes[kGatherMax];
};
__global__ void gather_bytes(const GatherTable* t) {
  const char* src = t->src[blockIdx.x];
  char* dst = t->dst[blockIdx.x];
  const uint32_t n = t->bytes[blockIdx.x];
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
// 4-byte loads when source and destination share their alignment mod 4 (then bytes at the ends).
__global__ void gather_words(const GatherTable* t) {
  const char* src = t->src[blockIdx.x];
  char* dst = t->dst[blockIdx.x];
  const uint32_t n = t->bytes[blockIdx.x];
  if ((uintptr_t(src) & 3) != (uintptr_t(dst) & 3)) {
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    return;
  }
  const uint32_t head = min(n, uint32_t((4 - (uintptr_t(src) & 3)) & 3));
  if (threadIdx.x < head) dst[threadIdx.x] = src[threadIdx.x];
  const uint32_t words = (n - head) / 4;
  const auto* s4 = reinterpret_cast<const uint32_t*>(src + head);
  auto* d4 = reinterpret_cast<uint32_t*>(dst + head);
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) d4[i] = s4[i];
  const uint32_t tail = head + words * 4;
  if (threadIdx.x < n - tail) dst[tail + threadIdx.x] = src[tail + threadIdx.x];
}

int main() {
  CHECK(cudaSetDevice(0));
  CHECK(cudaFree(0));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t done;
  CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  char* pinned;
  CHECK(cudaHostAlloc(&pinned, 1 << 20, cudaHostAllocPortable));
  char* dev;
  CHECK(cudaMalloc(&dev, 1 << 20));
  std::vector<char> payload(kIn);
  for (size_t i = 0; i < kIn; ++i) payload[i] = char(i * 131);
  char* heap_src = static_cast<char*>(std::aligned_alloc(4096, kIn));
  char* mapped = nullptr;  // the "fresh mmap" source of the current request

  enum Src { kSame, kOther, kOtherMmap };
  const char* src_names[] = {"written by the same thread", "written by another thread",
                             "fresh mmap, written by another thread"};
  auto writer_for = [&](Src src) -> std::function<void(int)> {
    return [&, src](int) {
      if (src == kOtherMmap) {
        if (mapped != nullptr) munmap(mapped, kIn);
        mapped = static_cast<char*>(
            mmap(nullptr, kIn, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
        std::memcpy(mapped, payload.data(), kIn);
      } else {
        std::memcpy(heap_src, payload.data(), kIn);
      }
    };
  };
  auto source = [&](Src src) { return src == kOtherMmap ? mapped : heap_src; };

  std::printf("# 1. small request's host copy (3 x 128 KiB -> one pinned buffer), median us\n");
  const CopyFn copies[] = {CopyGlibc, CopyStream, CopyRepMovsb};
  const char* copy_names[] = {"glibc memcpy", "non-temporal stores", "rep movsb"};
  for (int src = 0; src < 3; ++src) {
    for (int c = 0; c < 3; ++c) {
      auto samples = OnLane(writer_for(Src(src)), src == kSame, [&](int) {
        const char* from = source(Src(src));
        const auto a = Clock::now();
        for (size_t p = 0; p < kPieces; ++p) copies[c](pinned + p * kPiece, from + p * kPiece, kPiece);
        return us(a, Clock::now());
      });
      std::printf("  %-40s %-22s %7.1f\n", src_names[src], copy_names[c], median(samples));
    }
  }

  std::printf("# 2. whole small request, source written by another thread: host us until queued / "
              "until the last copy is done (median)\n");
  for (int way = 0; way < 4; ++way) {
    std::vector<double> queued;
    auto samples = OnLane(writer_for(kOther), false, [&](int) {
      const char* from = heap_src;
      const auto a = Clock::now();
      if (way == 0 || way == 1) {
        const CopyFn copy = way == 0 ? CopyGlibc : CopyStream;
        for (size_t p = 0; p < kPieces; ++p) copy(pinned + p * kPiece, from + p * kPiece, kPiece);
        cudaMemcpyAsync(dev, pinned, kIn, cudaMemcpyHostToDevice, s);
      } else if (way == 2) {
        for (size_t p = 0; p < kPieces; ++p) {
          cudaMemcpyAsync(dev + p * kPiece, from + p * kPiece, kPiece, cudaMemcpyHostToDevice, s);
        }
      } else {
        for (size_t p = 0; p < kPieces; ++p) {
          CopyStream(pinned + p * kPiece, from + p * kPiece, kPiece);
          cudaMemcpyAsync(dev + p * kPiece, pinned + p * kPiece, kPiece, cudaMemcpyHostToDevice, s);
        }
      }
      tiny<<<132, 128, 0, s>>>(dev);
      cudaMemcpyAsync(pinned + kIn, dev + kIn, kOut, cudaMemcpyDeviceToHost, s);
      cudaEventRecord(done, s);
      const auto b = Clock::now();
      while (cudaEventQuery(done) == cudaErrorNotReady) {
      }
      queued.push_back(us(a, b));
      return us(a, Clock::now());
    });
    CHECK(cudaGetLastError());
    const char* names[] = {"stage (glibc) + 1 H2D", "stage (non-temporal) + 1 H2D",
                           "3 H2D from pageable source", "3 x (non-temporal stage + H2D)"};
    queued.erase(queued.begin(), queued.begin() + kWarmup);
    std::printf("  %-34s queued %7.1f  done %7.1f\n", names[way], median(queued), median(samples));
  }

  std::printf("# 3. T threads each copying 48 MiB (4 MiB pieces) heap -> pinned at once: aggregate "
              "GB/s, median of 5 rounds\n");
  constexpr size_t kMedium = size_t{48} << 20, kChunk = size_t{4} << 20;
  for (int threads : {1, 4, 8, 16}) {
    std::vector<char*> src(threads), dst(threads);
    for (int t = 0; t < threads; ++t) {
      src[t] = static_cast<char*>(std::aligned_alloc(4096, kMedium));
      std::memset(src[t], t + 1, kMedium);
      CHECK(cudaHostAlloc(&dst[t], kMedium, cudaHostAllocPortable));
      std::memset(dst[t], 0, kMedium);
    }
    for (int c = 0; c < 2; ++c) {
      const CopyFn copy = c == 0 ? CopyGlibc : CopyStream;
      std::vector<double> rates;
      for (int round = 0; round < 6; ++round) {
        std::vector<std::thread> pool;
        const auto a = Clock::now();
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            for (size_t off = 0; off < kMedium; off += kChunk) copy(dst[t] + off, src[t] + off, kChunk);
          });
        }
        for (auto& th : pool) th.join();
        const double seconds = us(a, Clock::now()) * 1e-6;
        if (round > 0) rates.push_back(double(kMedium) * threads / seconds * 1e-9);
      }
      std::printf("  threads %2d  %-22s %6.1f GB/s\n", threads, copy_names[c], median(rates));
    }
    for (int t = 0; t < threads; ++t) {
      std::free(src[t]);
      cudaFreeHost(dst[t]);
    }
  }

  std::printf("# 4. small request's copy split over the lane and H helpers spinning for work (source written by "
              "another thread, glibc memcpy), median us\n");
  for (int helpers : {0, 1, 2, 3, 5}) {
    const int parts = helpers + 1;
    std::atomic<int> go{0}, finished{0};
    std::atomic<bool> quit{false};
    const char* from = heap_src;
    auto part = [&](int i) {  // equal slices of the 384 KiB, 64-byte aligned
      const size_t per = (kIn / parts + 63) / 64 * 64, begin = std::min(kIn, per * i);
      std::memcpy(pinned + begin, from + begin, std::min(kIn, begin + per) - begin);
    };
    std::vector<std::thread> pool;
    for (int h = 0; h < helpers; ++h) {
      pool.emplace_back([&, h] {
        for (int seen = 0;;) {
          int now;
          while ((now = go.load(std::memory_order_acquire)) == seen && !quit.load(std::memory_order_relaxed)) {
            _mm_pause();
          }
          if (quit.load()) return;
          seen = now;
          part(h + 1);
          finished.fetch_add(1, std::memory_order_acq_rel);
        }
      });
    }
    auto samples = OnLane(writer_for(kOther), false, [&](int) {
      const auto a = Clock::now();
      finished.store(0, std::memory_order_relaxed);
      go.fetch_add(1, std::memory_order_release);
      part(0);
      while (finished.load(std::memory_order_acquire) != helpers) _mm_pause();
      return us(a, Clock::now());
    });
    quit = true;
    for (auto& th : pool) th.join();
    std::printf("  helpers %d  %7.1f\n", helpers, median(samples));
  }

  std::printf("# 5. a medium request (48 MiB, heap, written) to the device: host copy into pinned memory + H2D, "
              "or cudaHostRegister the heap pieces in place + H2D + unregister; per piece size, median of 7: "
              "wall ms / CPU ms of the calling thread\n");
  {
    constexpr size_t kBytes = size_t{48} << 20;
    char* heap = static_cast<char*>(std::malloc(kBytes + 4096)) + 64;  // like a receive buffer: not page-aligned
    std::memset(heap, 7, kBytes);
    char* pinned48;
    CHECK(cudaHostAlloc(&pinned48, kBytes, cudaHostAllocPortable));
    std::memset(pinned48, 0, kBytes);
    char* dev48;
    CHECK(cudaMalloc(&dev48, kBytes));
    auto cpu_ms = [] {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
    };
    for (size_t piece : {size_t{128} << 10, size_t{4} << 20, kBytes}) {
      for (int way = 0; way < 2; ++way) {
        std::vector<double> wall, cpu;
        bool failed = false;
        for (int round = 0; round < 8 && !failed; ++round) {
          std::memset(heap, round, kBytes);  // written again, as a fresh request would be
          const auto a = Clock::now();
          const double c0 = cpu_ms();
          for (size_t off = 0; off < kBytes; off += piece) {
            if (way == 0) {
              std::memcpy(pinned48 + off, heap + off, piece);
              CHECK(cudaMemcpyAsync(dev48 + off, pinned48 + off, piece, cudaMemcpyHostToDevice, s));
            } else {
              if (const cudaError_t e = cudaHostRegister(heap + off, piece, cudaHostRegisterDefault); e != cudaSuccess) {
                // Pieces that are not page-aligned share a page with their neighbour.
                std::printf("  piece %zu KiB at offset %zu: cudaHostRegister: %s\n", piece >> 10, off,
                            cudaGetErrorString(e));
                cudaGetLastError();
                failed = true;
                break;
              }
              CHECK(cudaMemcpyAsync(dev48 + off, heap + off, piece, cudaMemcpyHostToDevice, s));
            }
          }
          CHECK(cudaStreamSynchronize(s));
          if (way == 1) {
            for (size_t off = 0; off < kBytes; off += piece) cudaHostUnregister(heap + off);
            cudaGetLastError();
          }
          if (round > 0) {
            wall.push_back(us(a, Clock::now()) * 1e-3);
            cpu.push_back(cpu_ms() - c0);
          }
        }
        if (failed) continue;
        std::printf("  piece %8zu KiB  %-34s wall %7.2f ms  cpu %7.2f ms\n", piece >> 10,
                    way == 0 ? "memcpy to pinned + H2D" : "register in place + H2D + unregister",
                    median(wall), median(cpu));
      }
    }
    cudaFree(dev48);
    cudaFreeHost(pinned48);
  }

  std::printf("# 6. a medium request (48 MiB) already in page-locked memory as gRPC's 64 KiB read buffers (pieces "
              "with 104-byte gaps, data 8-byte aligned, q starting 5 bytes in) to the device: median ms of 9\n");
  {
    constexpr size_t kBytes = size_t{48} << 20, kPiece = size_t{64} << 10, kStride = kPiece + 4096;
    const size_t pieces = kBytes / kPiece;
    char* arena;
    CHECK(cudaHostAlloc(&arena, pieces * kStride + 4096, cudaHostAllocPortable));
    std::memset(arena, 3, pieces * kStride + 4096);
    char* dev48;
    CHECK(cudaMalloc(&dev48, kBytes + 4096));
    std::vector<void*> dsts(pieces);
    std::vector<const void*> srcs(pieces);
    std::vector<size_t> sizes(pieces, kPiece);
    for (size_t i = 0; i < pieces; ++i) {
      srcs[i] = arena + i * kStride + 104 + (i == 0 ? 5 : 0);
      dsts[i] = dev48 + i * kPiece;
    }
    GatherTable* table;
    CHECK(cudaHostAlloc(&table, sizeof(GatherTable) * ((pieces + kGatherMax - 1) / kGatherMax),
                        cudaHostAllocPortable));
    auto run = [&](int way) {
      std::vector<double> ms;
      for (int round = 0; round < 10; ++round) {
        const auto a = Clock::now();
        if (way == 0) {
          CHECK(cudaMemcpyAsync(dev48, arena, kBytes, cudaMemcpyHostToDevice, s));
        } else if (way == 1 || way == 2) {
          cudaMemcpyAttributes attributes = {};
          attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          attributes.flags = way == 1 ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
          size_t index = 0;
          CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), pieces, &attributes, &index, 1, s));
        } else if (way == 3) {
          for (size_t i = 0; i < pieces; ++i) {
            CHECK(cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyHostToDevice, s));
          }
        } else {
          for (size_t first = 0, t = 0; first < pieces; first += kGatherMax, ++t) {
            const int n = int(std::min(pieces - first, size_t(kGatherMax)));
            table[t].n = n;
            for (int i = 0; i < n; ++i) {
              table[t].src[i] = static_cast<const char*>(srcs[first + i]);
              table[t].dst[i] = static_cast<char*>(dsts[first + i]);
              table[t].bytes[i] = uint32_t(sizes[first + i]);
            }
            if (way == 4) gather_bytes<<<n, 256, 0, s>>>(&table[t]);
            else gather_words<<<n, 256, 0, s>>>(&table[t]);
          }
        }
        CHECK(cudaStreamSynchronize(s));
        if (round > 0) ms.push_back(us(a, Clock::now()) * 1e-3);
      }
      return median(ms);
    };
    const char* names[] = {"one contiguous copy (reference)", "batch, prefer overlap with compute",
                           "batch, no flags", "one cudaMemcpyAsync per piece", "gather kernel, byte loads",
                           "gather kernel, 4-byte loads where aligned"};
    for (int way = 0; way < 6; ++way) {
      const double ms = run(way);
      std::printf("  %-44s %7.2f ms  %6.1f GB/s\n", names[way], ms, double(kBytes) / ms * 1e-6);
    }
    // The gather kernels must have copied the bytes right.
    std::vector<char> back(kBytes), want(kBytes);
    for (size_t i = 0; i < pieces; ++i) {
      for (size_t j = 0; j < kPiece; ++j) static_cast<char*>(const_cast<void*>(srcs[i]))[j] = char(i * 7 + j);
      std::memcpy(want.data() + i * kPiece, srcs[i], kPiece);
    }
    for (int way = 4; way < 6; ++way) {
      CHECK(cudaMemset(dev48, 0, kBytes));
      run(way);
      CHECK(cudaMemcpy(back.data(), dev48, kBytes, cudaMemcpyDeviceToHost));
      std::printf("  %s: %s\n", names[way], back == want ? "bytes right" : "BYTES WRONG");
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
