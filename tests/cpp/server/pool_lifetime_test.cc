// Buffers that outlive the PinnedPool they came from. At shutdown the server destroys the backend
// (which owns the staging pool) after the gRPC edge, and nothing in gRPC's API promises that the
// slices of an answer -- a DecodeStep's AnswerBuffer, an Attention call's IoBuffers -- are gone by
// then (a transport's buffers are freed on its own threads). Such a buffer must be freed through
// the allocator then, never handed back to the destroyed pool.
//
// Before the fix this was a use after free: each scenario runs in a child process (a death test
// asserting a clean exit) so that the heap it corrupts, or the loop it hangs in, cannot take the
// rest of the binary with it.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "edge/grpc/answer_slices.h"
#include "edge/sequences/answer_buffer.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "memory/pinned_pool.h"

namespace flashserve {
namespace {

constexpr size_t KiB = 1024;
constexpr unsigned kChildSeconds = 10;  // a child hung in a freed pool is killed, not waited for

// malloc-backed; its counts live outside it (the pool owns and destroys the allocator).
struct AllocatorCounts {
  std::atomic<int> allocations{0}, frees{0};
  std::mutex mu;
  std::set<void*> live;
};

class CountingAllocator final : public HostAllocator {
 public:
  explicit CountingAllocator(AllocatorCounts* counts) : counts_(counts) {}
  void* Allocate(size_t bytes) override {
    void* p = std::malloc(bytes);
    counts_->allocations++;
    std::lock_guard<std::mutex> lock(counts_->mu);
    counts_->live.insert(p);
    return p;
  }
  void Free(void* p) override {
    counts_->frees++;
    {
      std::lock_guard<std::mutex> lock(counts_->mu);
      if (counts_->live.erase(p) != 1) std::_Exit(3);  // not allocated, or freed twice
    }
    std::free(p);
  }

 private:
  AllocatorCounts* const counts_;
};

std::unique_ptr<PinnedPool> MakePool(AllocatorCounts* counts) {
  PinnedPoolOptions options;
  options.capacity_bytes = size_t{16} << 20;
  options.min_class_bytes = 64 * KiB;
  auto pool = PinnedPool::Create(options, std::make_unique<CountingAllocator>(counts));
  if (!pool.ok()) std::_Exit(4);
  return std::move(*pool);
}

// Exit code of a child: 0 when every block the allocator gave is back with it exactly once.
int EverythingFreed(AllocatorCounts& counts) {
  std::lock_guard<std::mutex> lock(counts.mu);
  return counts.live.empty() && counts.allocations == counts.frees ? 0 : 1;
}

// The pool is destroyed while a buffer is out (a reused one and a fresh one); returning the
// buffers afterwards frees them.
int ReturnBuffersAfterThePool() {
  alarm(kChildSeconds);
  AllocatorCounts counts;
  std::unique_ptr<PinnedPool> pool = MakePool(&counts);
  pool->Acquire(100 * KiB).reset();  // cached: the next one of its class is a reuse
  PinnedPool::Buffer reused = pool->Acquire(100 * KiB);
  PinnedPool::Buffer fresh = pool->Acquire(1000 * KiB);
  if (!reused || !fresh) return 5;
  std::memset(reused.data(), 1, reused.capacity());
  pool.reset();    // the backend goes at shutdown...
  reused.reset();  // ...and gRPC lets go of the answers after it
  fresh = PinnedPool::Buffer();
  return EverythingFreed(counts);
}

TEST(PinnedPoolLifetime, BuffersReturnedAfterThePoolIsDestroyedAreFreed) {
  EXPECT_EXIT(std::exit(ReturnBuffersAfterThePool()), ::testing::ExitedWithCode(0), "");
}

// A DecodeStep answer as gRPC has it (AnswerByteBuffer): its slices still read O after the pool is
// destroyed, and dropping them then frees the answer buffer.
int ReleaseAnswerSlicesAfterThePool() {
  alarm(kChildSeconds);
  AllocatorCounts counts;
  std::unique_ptr<PinnedPool> pool = MakePool(&counts);
  std::shared_ptr<AnswerBuffer> buffer = AnswerBuffer::Acquire(pool.get(), 4 * KiB, 0);
  if (buffer == nullptr) return 5;
  v1::DecodeStepResponse response;
  v1::Tensor* out = response.add_results()->mutable_out();
  out->set_dtype(v1::FLOAT16);
  for (int64_t d : {int64_t{1}, int64_t{16}, int64_t{128}}) out->add_shape(d);
  char* o = buffer->TakeOut(4 * KiB, out);
  if (o == nullptr) return 6;
  std::memset(o, 0x5a, 4 * KiB);
  AnswerPieces pieces = EncodeDecodeStepAnswer(&response, buffer.get());
  grpc::ByteBuffer answer = AnswerByteBuffer(std::move(pieces), std::move(buffer), nullptr);
  pool.reset();  // ~Server: the backend (and its staging pool) goes after the gRPC edge
  grpc::Slice joined;
  if (!answer.DumpToSingleSlice(&joined).ok()) return 7;
  const std::string wire(reinterpret_cast<const char*>(joined.begin()), joined.size());
  v1::DecodeStepResponse parsed;
  const std::string o_sent(4 * KiB, 0x5a);
  if (!parsed.ParseFromString(wire) || parsed.results(0).out().data() != o_sent) return 8;
  joined = grpc::Slice();
  answer.Clear();  // the transport drops the last slice
  return EverythingFreed(counts);
}

TEST(AnswerSlicesLifetime, SlicesReleasedAfterThePoolIsDestroyedFreeTheAnswerBuffer) {
  EXPECT_EXIT(std::exit(ReleaseAnswerSlicesAfterThePool()), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace flashserve
