#include "runtime/sequence_runtime.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "memory/host_memory_bound.h"
#include "runtime/decode_batcher.h"

namespace flashserve {

namespace {

// Decode calls that wait for an Append to their sequences (AwaitAppendsThenEnqueue): threads
// that wait, and calls queued for them; more are refused (RESOURCE_EXHAUSTED).
constexpr int kAppendWaitThreads = 4;
constexpr int kAppendWaitCapacity = 1024;

// Calls whose plans can share one paged launch: same shape, page format, mask and scale.
bool SameLaunch(const kvcache::PagedBatch& a, const kvcache::PagedBatch& b) {
  const kvcache::SequenceShape& x = a.shape;
  const kvcache::SequenceShape& y = b.shape;
  return x.heads_q == y.heads_q && x.heads_kv == y.heads_kv && x.head_dim == y.head_dim &&
         x.dtype == y.dtype && a.format.page_bytes == b.format.page_bytes &&
         a.format.page_tokens == b.format.page_tokens && a.causal == b.causal &&
         std::memcmp(&a.softmax_scale, &b.softmax_scale, sizeof(float)) == 0;
}

// Nobody waits for the call's answer any more.
bool Gone(const DecodeCall& call) {
  return (call.cancelled && call.cancelled()) || absl::Now() >= call.deadline;
}

// What a call of a launch the store stopped (PagedBatch::stop) is answered.
absl::Status StoppedAnswer(const DecodeCall& call, const absl::Status& stopped) {
  if (absl::Now() >= call.deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("deadline passed while computing; ", stopped.message()));
  }
  return absl::CancelledError(absl::StrCat("cancelled while computing; ", stopped.message()));
}

// What a call whose launch failed is answered: its rows were appended before the launch (and
// stay), so a code clients read as "nothing appended" (RESOURCE_EXHAUSTED for launch scratch the
// store could not get, INVALID_ARGUMENT) becomes INTERNAL, which SEQUENCES_API.md says may have
// appended: a retry with expected_length appends nothing twice. Attend-only calls keep the code.
absl::Status FailedLaunchAnswer(const DecodeCall& call, const DecodeReport& report,
                                const absl::Status& failed) {
  bool appended = false;
  for (size_t i = 0; i < call.items.size(); ++i) {
    const bool found_there = i < report.already_appended.size() && report.already_appended[i];
    appended |= call.items[i].k.rows > 0 && !found_there;
  }
  if (!appended || failed.code() == absl::StatusCode::kInternal) return failed;
  return absl::InternalError(
      absl::StrCat("the launch failed after the call's rows were appended (they stay: retry with "
                   "expected_length): ",
                   absl::StatusCodeToString(failed.code()), ": ", failed.message()));
}

}  // namespace

// A call whose rows are appended and whose sequences are pinned, waiting for its launch.
struct PreparedDecode {
  std::shared_ptr<DecodeCall> call;
  kvcache::StepPlan plan;
  DecodeReport report;
};
using Prepared = PreparedDecode;

absl::Status SequenceRuntimeOptions::Check() const {
  if (absl::Status s = cache.Check(); !s.ok()) return s;
  if (batch_window_us < 0 || batch_window_us > 1000000) {
    return absl::InvalidArgumentError("--batch_window_us must be in [0, 1000000]");
  }
  // The decode kernel's batch is a grid dimension (at most 65535): a merged launch of 65536
  // failed after every call's rows were appended.
  if (max_batch_sequences < 1 || max_batch_sequences > 65535) {
    return absl::InvalidArgumentError("--max_batch_sequences must be in [1, 65535]");
  }
  if (launches_in_flight < 1 || launches_in_flight > 4) {
    return absl::InvalidArgumentError("--decode_launches_in_flight must be in [1, 4]");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SequenceRuntime>> SequenceRuntime::Create(
    const SequenceRuntimeOptions& options, Backend* backend, Scheduler* scheduler,
    ServerMetrics* metrics) {
  if (absl::Status s = options.Check(); !s.ok()) return s;
  // The CPU store maps its pool lazily (MAP_NORESERVE), so mmap takes a pool larger than the
  // host and the OOM killer ends the process once sequences fill it. A CUDA pool is allocated
  // whole at once, and cudaMalloc refuses one past the device's memory.
  if (backend->capabilities().name == "cpu") {
    if (absl::Status s = CheckFitsHostMemory("kv_cache_bytes", options.cache.capacity_bytes,
                                             ReadHostMemoryBound());
        !s.ok()) {
      return s;
    }
  }
  auto runtime = std::unique_ptr<SequenceRuntime>(new SequenceRuntime(options, scheduler));
  absl::StatusOr<std::unique_ptr<kvcache::KvStore>> store =
      backend->CreateKvStore(options.cache.capacity_bytes, options.launches_in_flight);
  if (!store.ok()) {
    return absl::Status(store.status().code() == absl::StatusCode::kUnimplemented
                            ? absl::StatusCode::kFailedPrecondition
                            : store.status().code(),
                        absl::StrCat("--kv_cache_bytes: ", store.status().message()));
  }
  runtime->store_ = std::move(*store);
  if (metrics != nullptr) {
    runtime->metrics_ = std::make_unique<kvcache::KvCacheMetrics>(&metrics->registry());
    runtime->request_metrics_ = metrics;
  }
  absl::StatusOr<std::unique_ptr<kvcache::SequenceCache>> cache =
      kvcache::SequenceCache::Create(options.cache, runtime->store_.get(), runtime->metrics_.get());
  if (!cache.ok()) return cache.status();
  runtime->cache_ = std::move(*cache);
  // An infinite TTL evicts nothing: no sweeper.
  if (options.cache.ttl > absl::ZeroDuration() && options.cache.ttl != absl::InfiniteDuration()) {
    runtime->sweeper_ = std::thread([self = runtime.get()] { self->SweepIdle(); });
  }
  if (options.batch_window_us > 0 || options.batch_when_busy) {
    SequenceRuntime* self = runtime.get();
    // A batch handed on while no worker is free would only wait in the scheduler's queue, where
    // it can no longer take in later calls.
    const int running = std::min(options.launches_in_flight, scheduler->num_workers());
    runtime->batcher_ = std::make_unique<DecodeBatcher>(
        absl::Microseconds(options.batch_window_us), options.max_batch_sequences,
        options.batch_when_busy, running,
        [self](DecodeBatcher::Batch batch, bool on_caller_thread) {
          // A call handed on from its own (waiting) thread may run there, as without a batcher.
          const bool run_inline = on_caller_thread && batch.size() == 1 && batch[0]->caller_waits;
          self->Dispatch(std::move(batch), true, run_inline);
        });
  }
  return runtime;
}

SequenceRuntime::SequenceRuntime(const SequenceRuntimeOptions& options, Scheduler* scheduler)
    : options_(options),
      scheduler_(scheduler),
      append_waits_(std::make_unique<WorkQueue>(kAppendWaitThreads, kAppendWaitCapacity)) {}

void SequenceRuntime::SweepIdle() {
  // At most hourly: a TTL of centuries (or infinite) made ttl / 8 overflow the steady clock's
  // deadline inside wait_for, which then returned at once and the sweeper spun on a core.
  const auto every = absl::ToChronoNanoseconds(
      std::clamp(options_.cache.ttl / 8, absl::Milliseconds(10), absl::Hours(1)));
  std::unique_lock<std::mutex> lock(sweep_mu_);
  while (!sweep_stop_.wait_for(lock, every, [this] { return sweep_stopping_; })) {
    cache_->EvictIdle();
  }
}

SequenceRuntime::~SequenceRuntime() {
  append_waits_.reset();  // every call it holds goes on to the batcher or the scheduler
  {
    std::lock_guard<std::mutex> lock(sweep_mu_);
    sweep_stopping_ = true;
  }
  sweep_stop_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  // Hands on what the batcher holds (more jobs), then lets every job end: a queued one would run
  // RunCalls on the freed runtime, a running one unpin in the freed cache.
  if (batcher_ != nullptr) batcher_->Stop();  // its batches still call batcher_->BatchDone
  jobs_.WaitForNone("sequence runtime");
  batcher_.reset();
}

void SequenceRuntime::Submit(std::shared_ptr<DecodeCall> call) {
  call->submitted = absl::Now();
  const int n = int(call->items.size());
  if (n < 1 || n > options_.max_batch_sequences) {
    call->done(absl::InvalidArgumentError(absl::StrCat("a DecodeStep holds 1..",
                                                       options_.max_batch_sequences,
                                                       " items (--max_batch_sequences), got ", n)),
               {});
    return;
  }
  MarkWaiting(call.get());
  if (cache_->AnyAppending(call->items)) {
    AwaitAppendsThenEnqueue(std::move(call));
    return;
  }
  Enqueue(std::move(call));
}

void SequenceRuntime::Enqueue(std::shared_ptr<DecodeCall> call) {
  if (batcher_ == nullptr) {
    const bool run_inline = call->caller_waits;
    Dispatch({std::move(call)}, false, run_inline);
    return;
  }
  const int n = int(call->items.size());
  if (absl::Status s = batcher_->Add(call, n); !s.ok()) call->done(s, {});
}

void SequenceRuntime::AwaitAppendsThenEnqueue(std::shared_ptr<DecodeCall> call) {
  // A call that gave up waiting is enqueued all the same: Prepare answers it as stale.
  auto wait_then_enqueue = [this, call] {
    cache_->AwaitAppends(call->items, call->deadline, call->cancelled);
    Enqueue(call);
  };
  if (call->caller_waits) {
    wait_then_enqueue();
  } else if (!append_waits_->TrySubmit(wait_then_enqueue)) {
    call->done(absl::ResourceExhaustedError(
                   absl::StrCat("too many decode calls (", kAppendWaitCapacity,
                                ") wait for appends to their sequences; retry later")),
               {});
  }
}

void SequenceRuntime::MarkWaiting(DecodeCall* call) {
  if (options_.cache.ttl == absl::ZeroDuration()) return;
  kvcache::SequenceCache* cache = cache_.get();
  auto left = std::make_shared<std::atomic<bool>>(false);
  call->stop_waiting = [cache, since = cache->CallWaiting(), left] {
    if (!left->exchange(true)) cache->CallLeft(since);
  };
  // Every answer (refused by the queue, dropped as stale, run) ends the wait, before the runtime
  // (and its cache) can go: the destructor waits for every call handed on to be answered.
  call->done = [stop = call->stop_waiting, done = std::move(call->done)](
                   const absl::Status& status, const DecodeReport& report) {
    stop();
    done(status, report);
  };
}

void SequenceRuntime::Dispatch(std::vector<std::shared_ptr<DecodeCall>> calls, bool from_batcher,
                               bool run_inline) {
  // Shared by the job and this call: a refused job is destroyed in Submit, before the answers
  // below, which still use this runtime.
  auto ticket = std::make_shared<JobCount::Ticket>(&jobs_);
  Scheduler::Job job = [this, calls, from_batcher, ticket]() mutable {
    RunCalls(std::move(calls), from_batcher);
  };
  absl::Status s = run_inline ? scheduler_->SubmitOrRunInline(std::move(job))
                              : scheduler_->Submit(std::move(job));
  if (!s.ok()) {
    for (const auto& call : calls) call->done(s, {});
    if (from_batcher) batcher_->BatchDone();
  }
}

std::optional<PreparedDecode> SequenceRuntime::Prepare(std::shared_ptr<DecodeCall> call,
                                                       absl::Time start) {
  if (absl::Status stale = StaleCallStatus(*call, start); !stale.ok()) {
    call->done(stale, {});
    return std::nullopt;
  }
  const absl::Time t0 = absl::Now();
  absl::StatusOr<kvcache::StepPlan> plan =
      cache_->PrepareStep(call->items, call->deadline, call->cancelled);
  if (call->stop_waiting) call->stop_waiting();  // its sequences are marked used (or it failed)
  if (!plan.ok()) {
    call->done(plan.status(), {});
    return std::nullopt;
  }
  // Counted once the call really runs (a queue or batcher that refused it counts nothing).
  if (request_metrics_ != nullptr) {
    if (call->shm_system_inputs) request_metrics_->RecordInputPath("shm_system");
    if (call->shm_cuda_inputs) request_metrics_->RecordInputPath("shm_cuda");
  }
  Prepared p{call, std::move(*plan), {}};
  p.report.prepare_us = absl::ToInt64Microseconds(call->submitted - call->received);
  p.report.queue_us = absl::ToInt64Microseconds(start - call->submitted);
  p.report.append_us = absl::ToInt64Microseconds(absl::Now() - t0);
  p.plan.batch.causal = call->causal;
  p.plan.batch.softmax_scale = call->softmax_scale;
  for (size_t i = 0; i < p.plan.batch.items.size(); ++i) {
    kvcache::PagedItem& item = p.plan.batch.items[i];
    item.out = call->out[i];
    item.lse = call->lse.empty() ? nullptr : call->lse[i];
    if (i < call->out_at.size()) item.out_at = call->out_at[i];
    if (i < call->lse_at.size()) item.lse_at = call->lse_at[i];
    p.report.lengths.push_back(p.plan.batch.items[i].length);
  }
  p.report.already_appended = p.plan.already_appended;
  return p;
}

void SequenceRuntime::RunCalls(std::vector<std::shared_ptr<DecodeCall>> calls,
                               bool from_batcher) {
  const absl::Time start = absl::Now();
  std::vector<Prepared> ready;
  for (auto& call : calls) {
    std::optional<Prepared> p = Prepare(std::move(call), start);
    if (p.has_value()) ready.push_back(std::move(*p));
  }
  // Greedy grouping: each call joins the first launch it fits (shape, mask, scale, size).
  std::vector<std::vector<Prepared*>> launches;
  std::vector<size_t> sizes;
  for (Prepared& p : ready) {
    const size_t n = p.plan.batch.items.size();
    size_t g = 0;
    while (g < launches.size() && !(SameLaunch(launches[g][0]->plan.batch, p.plan.batch) &&
                                    sizes[g] + n <= size_t(options_.max_batch_sequences))) {
      ++g;
    }
    if (g == launches.size()) {
      launches.emplace_back();
      sizes.push_back(0);
    }
    launches[g].push_back(&p);
    sizes[g] += n;
  }
  for (const auto& launch : launches) RunLaunch(launch);
  if (from_batcher) batcher_->BatchDone();
}

void SequenceRuntime::RunLaunch(const std::vector<Prepared*>& launch) {
  kvcache::PagedBatch merged;
  merged.shape = launch[0]->plan.batch.shape;
  merged.format = launch[0]->plan.batch.format;
  merged.causal = launch[0]->plan.batch.causal;
  merged.softmax_scale = launch[0]->plan.batch.softmax_scale;
  for (Prepared* p : launch) {
    for (kvcache::PagedItem& item : p->plan.batch.items) merged.items.push_back(std::move(item));
  }
  // Merged calls share the launch: it stops only when none of them waits.
  merged.stop = [&launch] {
    return std::all_of(launch.begin(), launch.end(), [](Prepared* p) { return Gone(*p->call); });
  };
  kvcache::AttendInfo info;
  const absl::Time t0 = absl::Now();
  const absl::Status status = store_->Attend(merged, &info);
  const int64_t compute_us = absl::ToInt64Microseconds(absl::Now() - t0);
  if (metrics_ != nullptr)
    metrics_->RecordLaunch(int64_t(merged.items.size()), int64_t(launch.size()));
  for (Prepared* p : launch) {
    p->report.compute_us = compute_us;
    p->report.kernel = info.kernel;
    p->report.h2d_us = info.h2d_us;
    p->report.kernel_us = std::max<int64_t>(info.kernel_us, 0);
    p->report.d2h_us = info.d2h_us;
    p->report.batched_calls = int(launch.size());
    p->plan = kvcache::StepPlan();  // unpin before answering
    const bool stopped = status.code() == absl::StatusCode::kCancelled;
    p->call->done(stopped       ? StoppedAnswer(*p->call, status)
                  : status.ok() ? status
                                : FailedLaunchAnswer(*p->call, p->report, status),
                  p->report);
  }
}

}  // namespace flashserve
