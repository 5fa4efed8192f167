// The CPU backend stops a running job nobody waits for: DEADLINE_EXCEEDED within ~100 ms of its
// deadline, no output in the response, and the worker free for the next request. The large
// problem, q = k = v fp32 [1, 200000, 1, 4], computes for ~15 s on 2 cores if it is not stopped.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "runtime/attention_runtime.h"
#include "runtime/cpu_backend.h"
#include "runtime/cpu_kv_store.h"
#include "runtime/sequence_runtime.h"
#include "stop_timing.h"

namespace flashserve {
namespace {

constexpr int kLargeSeqlen = 200000;
constexpr absl::Duration kPrompt = absl::Milliseconds(100);  // the stop's bound
constexpr absl::Duration kSlack = absl::Milliseconds(150);   // scheduling on a loaded machine
const std::chrono::nanoseconds kBound = absl::ToChronoNanoseconds(kPrompt + kSlack);
constexpr int kComputeThreads = 3;  // the backend's two and the thread that runs the job

// Marks (stop_timing.h) the moment a deadline passes, from a thread of its own.
std::thread MarkAt(absl::Time when, test::StopMark* mark) {
  return std::thread([when, mark] {
    absl::SleepFor(when - absl::Now());
    *mark = test::StopMark();
  });
}

std::unique_ptr<CpuBackend> MakeBackend() {
  CpuBackendOptions options;
  options.num_threads = 2;
  options.buffer_pool_bytes = 0;
  return std::move(*CpuBackend::Create(options));
}

// fp32 zeros [1, seqlen, heads, head_dim] (the compute does not depend on the values).
void SetTensor(v1::Tensor* t, int seqlen, int heads, int head_dim) {
  t->set_dtype(v1::FLOAT32);
  for (int64_t d : {1, seqlen, heads, head_dim}) t->add_shape(d);
  t->set_data(std::string(size_t(seqlen) * heads * head_dim * 4, '\0'));
}

v1::AttentionRequest Request(int seqlen, int heads, int head_dim) {
  v1::AttentionRequest r;
  SetTensor(r.mutable_q(), seqlen, heads, head_dim);
  SetTensor(r.mutable_k(), seqlen, heads, head_dim);
  SetTensor(r.mutable_v(), seqlen, heads, head_dim);
  return r;
}

// A backend job over host vectors, as the runtime hands one to the backend.
struct Job {
  std::vector<float> q, o;
  BackendJob job;
  explicit Job(int seqlen) : q(size_t(seqlen) * 4), o(q.size()) {
    job.problem = {kernels::DType::kFloat32, 1, seqlen, seqlen, 1, 1, 4, false, 0.5f, false};
    const size_t bytes = q.size() * sizeof(float);
    job.tensors.q = TensorBytes::Contiguous(MemoryKind::kHeap, q.data(), bytes);
    job.tensors.k = job.tensors.v = job.tensors.q;
    job.tensors.o = {MemoryKind::kHeap, reinterpret_cast<char*>(o.data()), bytes};
  }
};

TEST(CpuBackendStop, DeadlineStopsARunningJob) {
  std::unique_ptr<CpuBackend> backend = MakeBackend();
  Job large(kLargeSeqlen);
  large.job.deadline = absl::Now() + absl::Milliseconds(200);
  test::StopMark due;
  std::thread marker = MarkAt(large.job.deadline, &due);
  PhaseTiming timing;
  std::string kernel;
  const absl::Status status = backend->Run(large.job, &timing, &kernel);
  const test::StopMark returned;
  marker.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_TRUE(test::StoppedPromptly(due, returned, kBound, kComputeThreads));
  EXPECT_TRUE(kernel.empty());

  Job small(300);  // the threads are free again and compute in full
  EXPECT_TRUE(backend->Run(small.job, &timing, &kernel).ok());
  EXPECT_EQ(kernel, "cpu_tiled_online_softmax");
}

TEST(CpuBackendStop, CancellationStopsARunningJob) {
  std::unique_ptr<CpuBackend> backend = MakeBackend();
  Job large(kLargeSeqlen);
  std::atomic<bool> gone{false};
  large.job.cancelled = [&gone] { return gone.load(); };
  test::StopMark cancelled_at;
  std::thread client([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    cancelled_at = test::StopMark();
    gone = true;
  });
  PhaseTiming timing;
  std::string kernel;
  const absl::Status status = backend->Run(large.job, &timing, &kernel);
  const test::StopMark returned;
  client.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE(test::StoppedPromptly(cancelled_at, returned, kBound, kComputeThreads));
}

// A runtime over the CPU backend with one scheduler worker, as the server runs it.
class CpuRuntime : public ::testing::Test {
 protected:
  struct Answer {
    std::future<test::StopMark> at;  // when done() ran
    std::shared_ptr<absl::Status> status;
  };
  Answer Submit(const v1::AttentionRequest* request, v1::AttentionResponse* response,
                absl::Time deadline, std::function<bool()> cancelled = {}) {
    auto at = std::make_shared<std::promise<test::StopMark>>();
    auto status = std::make_shared<absl::Status>();
    AttentionRuntime::Call call;
    call.request = request;
    call.response = response;
    call.received = absl::Now();
    call.deadline = deadline;
    call.cancelled = std::move(cancelled);
    call.done = [at, status](const absl::Status& s) {
      *status = s;
      at->set_value(test::StopMark());
    };
    runtime_.Submit(std::move(call));
    return {at->get_future(), status};
  }
  static ValidationLimits Limits() {
    ValidationLimits limits;
    limits.dtypes = {kernels::DType::kFloat32};
    return limits;
  }

  std::unique_ptr<CpuBackend> backend_ = MakeBackend();
  std::unique_ptr<Scheduler> scheduler_ = std::move(*Scheduler::Create({8, 1}));
  AttentionRuntime runtime_{backend_.get(), scheduler_.get(), Limits()};
  const v1::AttentionRequest large_ = Request(kLargeSeqlen, 1, 4), small_ = Request(64, 2, 32);
  v1::AttentionResponse large_response_, small_response_;
};

// The large call is answered DEADLINE_EXCEEDED without output, and a small call queued behind it
// on the one scheduler worker is answered at once.
TEST_F(CpuRuntime, DeadlineFreesTheWorkerForTheNextCall) {
  const absl::Time deadline = absl::Now() + absl::Milliseconds(300);
  test::StopMark due;
  std::thread marker = MarkAt(deadline, &due);
  Answer large = Submit(&large_, &large_response_, deadline);
  Answer small = Submit(&small_, &small_response_, absl::InfiniteFuture());

  ASSERT_EQ(large.at.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  marker.join();
  EXPECT_TRUE(test::StoppedPromptly(due, large.at.get(), kBound, kComputeThreads));
  EXPECT_EQ(large.status->code(), absl::StatusCode::kDeadlineExceeded) << *large.status;
  EXPECT_FALSE(large_response_.has_out());  // partial output is never an answer
  ASSERT_EQ(small.at.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(test::StoppedPromptly(due, small.at.get(), kBound, kComputeThreads));
  EXPECT_TRUE(small.status->ok()) << *small.status;
  EXPECT_EQ(small_response_.out().data().size(), size_t(64 * 2 * 32 * 4));
}

// A client that goes away mid-compute stops the job; the answer says it was the client.
TEST_F(CpuRuntime, ClientCancelStopsTheJob) {
  std::atomic<bool> gone{false};
  Answer large =
      Submit(&large_, &large_response_, absl::InfiniteFuture(), [&gone] { return gone.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const test::StopMark cancelled_at;
  gone = true;
  ASSERT_EQ(large.at.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(test::StoppedPromptly(cancelled_at, large.at.get(), kBound, kComputeThreads));
  EXPECT_EQ(large.status->code(), absl::StatusCode::kCancelled) << *large.status;
  EXPECT_TRUE(absl::StartsWith(large.status->message(), "cancelled by the client while computing"))
      << *large.status;
  EXPECT_FALSE(large_response_.has_out());
}

// The shutdown's grace is over: running work stops, and the answer (and its log line) says the
// server cancelled it, not the client -- though gRPC then reports every call cancelled too.
TEST_F(CpuRuntime, CancelRunningStopsTheJobAndNamesTheShutdown) {
  std::atomic<bool> grpc_cancelled{false};
  Answer large = Submit(&large_, &large_response_, absl::InfiniteFuture(),
                        [&grpc_cancelled] { return grpc_cancelled.load(); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const test::StopMark cancelled_at;
  runtime_.CancelRunning();
  grpc_cancelled = true;
  ASSERT_EQ(large.at.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(test::StoppedPromptly(cancelled_at, large.at.get(), kBound, kComputeThreads));
  EXPECT_EQ(large.status->code(), absl::StatusCode::kCancelled) << *large.status;
  EXPECT_TRUE(
      absl::StartsWith(large.status->message(),
                       "cancelled by the server's shutdown (grace period over) while computing"))
      << *large.status;
}

// Sequences: one paged launch of 16 rows x 512 query heads over 128k cached tokens (~5 s on 2
// cores) stops once batch.stop says that no call waits for it.
TEST(CpuKvStoreStop, LaunchStopsWhenNoCallWaits) {
  kernels::cpu::ThreadPool pool(2);
  kvcache::PagedBatch batch;
  batch.shape = {1, 512, 1, 128, kernels::DType::kFloat16};
  batch.format = kvcache::FormatFor(batch.shape, 256);
  batch.softmax_scale = 0.1f;
  constexpr int64_t kLength = 131072;
  std::unique_ptr<CpuKvStore> store =
      std::move(*CpuKvStore::Create(kLength / 256 * batch.format.page_bytes, &pool));
  std::vector<uint16_t> q(16 * 512 * 128), out(q.size());  // the store's pages read as zeros
  kvcache::PagedItem item;
  item.q = q.data();
  item.rows_q = 16;
  item.out = out.data();
  item.length = kLength;
  for (int32_t page = 0; page < kLength / 256; ++page) item.pages.push_back(page);
  batch.items.push_back(std::move(item));
  std::atomic<bool> gone{false};
  batch.stop = [&gone] { return gone.load(); };
  test::StopMark gone_at;
  std::thread client([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    gone_at = test::StopMark();
    gone = true;
  });
  kvcache::AttendInfo info;
  const absl::Status status = store->Attend(batch, &info);
  const test::StopMark returned;
  client.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_TRUE(test::StoppedPromptly(gone_at, returned, kBound, kComputeThreads));
}

// Gathering an item's pages asks the stop before each page (a 128k-token item's K alone is
// hundreds of MB): not stopped, every row lands in token order from pages in shuffled order, for
// keys and values, and nothing past the item's end; stopped, no byte is written.
TEST(CpuKvStoreStop, GatherAsksTheStopBeforeEachPage) {
  const kvcache::SequenceShape shape{1, 4, 2, 8, kernels::DType::kFloat16};
  const kvcache::PageFormat format = kvcache::FormatFor(shape, 16);
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  kvcache::PagedItem item;
  item.length = 4 * 16 + 1 + int64_t(rng() % 15);  // ends inside its fifth page
  item.pages = {3, 0, 4, 1, 2};
  std::shuffle(item.pages.begin(), item.pages.end(), rng);
  std::vector<char> pool(size_t(5 * format.page_bytes));
  for (char& b : pool) b = char(rng());
  constexpr char kPoison = char(0x5A);
  const size_t gathered = size_t(item.length * format.row_bytes);
  for (const int64_t add : {int64_t{0}, format.v_offset}) {
    std::vector<char> dst(gathered + size_t(format.row_bytes), kPoison);
    kernels::cpu::StopSignal go;
    ASSERT_TRUE(GatherPages(pool.data(), format, item, add, dst.data(), &go));
    for (int64_t t = 0; t < item.length; ++t) {
      const char* row = pool.data() + item.pages[size_t(t / 16)] * format.page_bytes + add +
                        (t % 16) * format.row_bytes;
      ASSERT_EQ(std::memcmp(dst.data() + t * format.row_bytes, row, size_t(format.row_bytes)), 0)
          << "token " << t << ", add " << add;
    }
    EXPECT_TRUE(
        std::all_of(dst.begin() + long(gathered), dst.end(), [](char b) { return b == kPoison; }));
    std::vector<char> stopped_dst(dst.size(), kPoison);
    kernels::cpu::StopSignal stop;
    stop.request();
    EXPECT_FALSE(GatherPages(pool.data(), format, item, add, stopped_dst.data(), &stop));
    EXPECT_TRUE(
        std::all_of(stopped_dst.begin(), stopped_dst.end(), [](char b) { return b == kPoison; }));
  }
}

// The same through the Sequences runtime: a DecodeStep whose deadline passes mid-launch is
// answered DEADLINE_EXCEEDED at once.
TEST(SequenceRuntimeStop, DecodeStepDeadlineStopsItsLaunch) {
  std::unique_ptr<CpuBackend> backend = MakeBackend();
  std::unique_ptr<Scheduler> scheduler = std::move(*Scheduler::Create({8, 1}));
  SequenceRuntimeOptions options;
  options.cache.capacity_bytes = int64_t{80} << 20;
  options.cache.page_tokens = 256;
  std::unique_ptr<SequenceRuntime> runtime =
      std::move(*SequenceRuntime::Create(options, backend.get(), scheduler.get(), nullptr));
  const kvcache::SequenceShape shape{1, 512, 1, 128, kernels::DType::kFloat16};
  const auto rows = [&shape](const std::vector<uint16_t>& bits, int64_t heads) {
    kvcache::HostRows r;
    r.dtype = shape.dtype;
    r.heads = heads;
    r.head_dim = shape.head_dim;
    r.rows = int64_t(bits.size()) / (heads * shape.head_dim);
    r.data = bits.data();
    return r;
  };
  const std::vector<uint16_t> prefix(size_t(131072 - 16) * 128);  // zeros: time is all that counts
  kvcache::CreateRequest create;
  create.shape = shape;
  create.prefix.push_back({0, rows(prefix, 1), rows(prefix, 1)});
  absl::StatusOr<kvcache::SequenceStatus> sequence = runtime->cache().CreateSequence(create);
  ASSERT_TRUE(sequence.ok()) << sequence.status();

  const std::vector<uint16_t> q(16 * 512 * 128), kv(16 * 128);
  std::vector<uint16_t> out(q.size());
  auto call = std::make_shared<DecodeCall>();
  call->items.push_back({sequence->id, 0, rows(q, 512), rows(kv, 1), rows(kv, 1)});
  call->softmax_scale = 0.1f;
  call->out.push_back(out.data());
  call->received = absl::Now();
  call->deadline = absl::Now() + absl::Milliseconds(300);
  test::StopMark due;
  std::thread marker = MarkAt(call->deadline, &due);
  auto answer = std::make_shared<std::promise<std::pair<absl::Status, test::StopMark>>>();
  call->done = [answer](const absl::Status& s, const DecodeReport&) {
    answer->set_value({s, test::StopMark()});
  };
  runtime->Submit(call);
  std::future<std::pair<absl::Status, test::StopMark>> done = answer->get_future();
  ASSERT_EQ(done.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  marker.join();
  const auto [status, at] = done.get();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_TRUE(test::StoppedPromptly(due, at, kBound, kComputeThreads));
}

}  // namespace
}  // namespace flashserve
