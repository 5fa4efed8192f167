// A decode call on a sequence that an Append is copying into waits for that copy off the
// scheduler: other clients' calls (the CPU backend has one worker; a batch holds several calls)
// run meanwhile, and the waiting call still sees the appended rows, or ends at its deadline or
// cancel with nothing appended. And a launch that fails after its call's rows were appended says
// so (INTERNAL), whatever code the store failed with.
#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kv_test_util.h"
#include "runtime/cpu_backend.h"
#include "runtime/sequence_runtime.h"

namespace flashserve {
namespace {

using kernels::DType;
using kvcache::testing::Bits;
using kvcache::testing::DenseLayer;
using kvcache::testing::RandomRows;
using kvcache::testing::Rows;

// The CPU backend's KV store, whose writes of kGatedBytes or more wait at a gate once armed.
class GatedKvStore final : public kvcache::KvStore {
 public:
  static constexpr int64_t kGatedBytes = 1024;  // an append's pages; a step's one row passes

  explicit GatedKvStore(std::unique_ptr<kvcache::KvStore> inner) : inner_(std::move(inner)) {}
  std::string_view kind() const override { return inner_->kind(); }
  int64_t capacity_bytes() const override { return inner_->capacity_bytes(); }
  absl::Status Write(int64_t offset, const void* src, int64_t bytes, kvcache::BytesAt at) override {
    if (armed_ && bytes >= kGatedBytes) gate_.Wait();
    return inner_->Write(offset, src, bytes, at);
  }
  absl::Status Attend(const kvcache::PagedBatch& batch, kvcache::AttendInfo* info) override {
    if (!fail_attend_.ok()) return fail_attend_;  // as the CUDA store without launch scratch
    return inner_->Attend(batch, info);
  }
  void Arm() { armed_ = true; }
  void FailAttend(absl::Status status) { fail_attend_ = std::move(status); }
  void WaitUntilBlocked() { gate_.WaitUntilWaiting(); }
  void Open() { gate_.Open(); }

 private:
  const std::unique_ptr<kvcache::KvStore> inner_;
  std::atomic<bool> armed_{false};
  absl::Status fail_attend_;  // set before any call runs
  kvcache::testing::Gate gate_;
};

// The CPU backend, its KV store gated.
class GatedBackend final : public Backend {
 public:
  explicit GatedBackend(std::unique_ptr<CpuBackend> cpu) : cpu_(std::move(cpu)) {}
  const BackendCapabilities& capabilities() const override { return cpu_->capabilities(); }
  absl::Status Run(const BackendJob& job, PhaseTiming* timing, std::string* kernel) override {
    return cpu_->Run(job, timing, kernel);
  }
  absl::StatusOr<std::unique_ptr<kvcache::KvStore>> CreateKvStore(int64_t bytes,
                                                                  int in_flight) override {
    absl::StatusOr<std::unique_ptr<kvcache::KvStore>> inner = cpu_->CreateKvStore(bytes, in_flight);
    if (!inner.ok()) return inner.status();
    auto store = std::make_unique<GatedKvStore>(std::move(*inner));
    store_ = store.get();
    return store;
  }
  GatedKvStore* store() { return store_; }

 private:
  std::unique_ptr<CpuBackend> cpu_;
  GatedKvStore* store_ = nullptr;
};

struct Answer {
  absl::Status status;
  DecodeReport report;
};

class AppendWaitTest : public ::testing::Test {
 protected:
  const kvcache::SequenceShape shape_{1, 2, 1, 64, DType::kFloat16};  // rows of 128 B

  // One scheduler worker, as the CPU backend has.
  void Make(int64_t window_us) {
    CpuBackendOptions cpu;
    cpu.num_threads = 2;
    backend_ = std::make_unique<GatedBackend>(*CpuBackend::Create(cpu));
    SchedulerOptions scheduler;
    scheduler.num_workers = 1;
    scheduler_ = *Scheduler::Create(scheduler);
    SequenceRuntimeOptions options;
    options.cache.capacity_bytes = 4 << 20;
    options.cache.page_tokens = 16;
    options.batch_window_us = window_us;
    options.max_batch_sequences = 8;
    options.launches_in_flight = 1;
    runtime_ = *SequenceRuntime::Create(options, backend_.get(), scheduler_.get(), nullptr);
  }

  // A sequence with a 4-row prefix (its writes pass the gate) mirrored in *dense.
  std::string Create(DenseLayer* dense) {
    Bits k = RandomRows(&rng_, 4, 1, 64, DType::kFloat16);
    Bits v = RandomRows(&rng_, 4, 1, 64, DType::kFloat16);
    dense->Append(k, v);
    kvcache::CreateRequest request;
    request.shape = shape_;
    request.prefix.push_back({0, Rows(k, 1, 64, DType::kFloat16), Rows(v, 1, 64, DType::kFloat16)});
    return runtime_->cache().CreateSequence(request)->id;
  }

  // Appends 32 rows to `id` on a thread of its own; returns once the copy waits at the gate.
  std::future<absl::StatusOr<kvcache::AppendResult>> BlockedAppend(const std::string& id,
                                                                   DenseLayer* dense) {
    big_k_ = RandomRows(&rng_, 32, 1, 64, DType::kFloat16);
    big_v_ = RandomRows(&rng_, 32, 1, 64, DType::kFloat16);
    dense->Append(big_k_, big_v_);
    backend_->store()->Arm();
    auto appended = std::async(std::launch::async, [this, id] {
      return runtime_->cache().Append(
          id, {{0, Rows(big_k_, 1, 64, DType::kFloat16), Rows(big_v_, 1, 64, DType::kFloat16)}});
    });
    backend_->store()->WaitUntilBlocked();
    return appended;
  }

  struct Holder {
    Bits q, k, v, out;
    std::promise<Answer> answer;
    std::future<Answer> future = answer.get_future();
  };
  // A one-item call appending one row to `id`; its buffers live in *h.
  std::shared_ptr<DecodeCall> Call(const std::string& id, Holder* h) {
    h->q = RandomRows(&rng_, 1, 2, 64, DType::kFloat16);
    h->k = RandomRows(&rng_, 1, 1, 64, DType::kFloat16);
    h->v = RandomRows(&rng_, 1, 1, 64, DType::kFloat16);
    h->out.assign(h->q.size(), 0x7e00);  // NaN: a row left unwritten fails the check
    auto call = std::make_shared<DecodeCall>();
    call->items.push_back({id, 0, Rows(h->q, 2, 64, DType::kFloat16),
                           Rows(h->k, 1, 64, DType::kFloat16), Rows(h->v, 1, 64, DType::kFloat16)});
    call->softmax_scale = 0.125f;
    call->out.push_back(h->out.data());
    call->received = absl::Now();
    call->done = [h](const absl::Status& status, const DecodeReport& report) {
      h->answer.set_value({status, report});
    };
    return call;
  }

  void ExpectCorrect(Holder* h, DenseLayer* dense, const std::string& what) {
    const Answer answer = h->future.get();
    ASSERT_TRUE(answer.status.ok()) << what << ": " << answer.status;
    dense->Append(h->k, h->v);
    ASSERT_EQ(answer.report.lengths.size(), 1u);
    EXPECT_EQ(answer.report.lengths[0], int64_t(dense->k.size() / 64)) << what;
    EXPECT_EQ(kvcache::testing::CheckAgainstReference(shape_, *dense, h->q, 1, false, 0.125f,
                                                      h->out, {}, what),
              0);
  }

  // Another sequence's call is answered while an append to the first one is stuck; the first
  // sequence's call waits for the append, then sees its rows.
  void OtherCallsRunWhileOneWaits(int64_t window_us) {
    Make(window_us);
    DenseLayer dense_a, dense_b;
    const std::string a = Create(&dense_a), b = Create(&dense_b);
    auto appended = BlockedAppend(a, &dense_a);
    Holder on_a, on_b;
    runtime_->Submit(Call(a, &on_a));
    runtime_->Submit(Call(b, &on_b));
    const bool b_answered =
        on_b.future.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
    const bool a_waited =
        on_a.future.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout;
    backend_->store()->Open();
    on_a.future.wait();  // every call answered before its holder goes, whatever failed
    on_b.future.wait();
    ASSERT_TRUE(b_answered) << "a call on another sequence waited for an Append's copy";
    EXPECT_TRUE(a_waited) << "the call on the sequence being appended to did not wait";
    ASSERT_TRUE(appended.get().ok());
    ExpectCorrect(&on_b, &dense_b, "call on the other sequence");
    ExpectCorrect(&on_a, &dense_a, "call after the append");
  }

  std::mt19937 rng_{11};
  Bits big_k_, big_v_;
  std::unique_ptr<GatedBackend> backend_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<SequenceRuntime> runtime_;
};

TEST_F(AppendWaitTest, WithoutAWindowTheWaitHoldsNoSchedulerWorker) {
  OtherCallsRunWhileOneWaits(0);
}

TEST_F(AppendWaitTest, InABatchWindowTheWaitHoldsNoOtherCall) { OtherCallsRunWhileOneWaits(20000); }

TEST_F(AppendWaitTest, AWaitEndsAtTheCallsDeadlineOrCancelWithNothingAppended) {
  Make(0);
  DenseLayer dense;
  const std::string id = Create(&dense);
  auto appended = BlockedAppend(id, &dense);
  Holder expiring, cancelled;
  auto call = Call(id, &expiring);
  call->deadline = absl::Now() + absl::Milliseconds(100);
  runtime_->Submit(call);
  auto gone = std::make_shared<std::atomic<bool>>(false);
  call = Call(id, &cancelled);
  call->cancelled = [gone] { return gone->load(); };
  runtime_->Submit(call);
  const bool expired =
      expiring.future.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  *gone = true;
  const bool left = cancelled.future.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  backend_->store()->Open();
  expiring.future.wait();
  cancelled.future.wait();
  ASSERT_TRUE(expired) << "a call waiting for an append outlived its deadline";
  ASSERT_TRUE(left) << "a call waiting for an append did not end when cancelled";
  EXPECT_EQ(expiring.future.get().status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(cancelled.future.get().status.code(), absl::StatusCode::kCancelled);
  ASSERT_TRUE(appended.get().ok());
  EXPECT_EQ(runtime_->cache().Info(id)->lengths[0], 4 + 32) << "a call that gave up appended";
}

// The CUDA store answered RESOURCE_EXHAUSTED when it could not get a launch's scratch, after
// PrepareStep had appended the call's rows: clients read that code as "nothing appended" (a retry
// without expected_length appended the token twice; with it, the next step was taken for a retry
// and attended over the failed step's rows). Found by an audit of the CUDA store.
TEST_F(AppendWaitTest, ALaunchThatFailsAfterTheAppendAnswersInternal) {
  Make(0);
  DenseLayer dense;
  const std::string id = Create(&dense);
  backend_->store()->FailAttend(absl::ResourceExhaustedError("KV launch scratch of 4096 bytes"));
  Holder appending;
  runtime_->Submit(Call(id, &appending));
  const Answer answered = appending.future.get();
  EXPECT_EQ(answered.status.code(), absl::StatusCode::kInternal) << answered.status;
  EXPECT_NE(answered.status.message().find("rows were appended"), std::string::npos)
      << answered.status;
  EXPECT_EQ(runtime_->cache().Info(id)->lengths[0], 4 + 1) << "the rows stay, as the answer says";
  // An attend-only call appended nothing: its code stays (retry later).
  Holder attending;
  auto call = Call(id, &attending);
  call->items[0].k = {};
  call->items[0].v = {};
  runtime_->Submit(call);
  EXPECT_EQ(attending.future.get().status.code(), absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace flashserve
