#include "edge/grpc/sequences_service.h"

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/work_queue.h"
#include "edge/grpc/answer_slices.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "edge/sequences/sequences_arena.h"
#include "edge/sequences/sequences_convert.h"
#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_hold.h"
#include "edge/sequences/sequences_shm.h"
#include "flashserve/v1/sequences.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/sequence_cache.h"
#include "kvcache/sequence_id.h"

namespace flashserve {

namespace {

using Admission = AttentionRuntime::Admission;

// The calls that may wait (Create, Append, Truncate: for another call's copy or a step's pin)
// wait on threads of the server's own (common/work_queue.h), never on gRPC's: waiting there, two
// of them stalled every call of the server (gRPC 1.51 has max(2, cores / 2) such threads).
constexpr int kControlThreads = 4;
constexpr int kControlQueue = 1024;  // calls waiting for those threads; more: RESOURCE_EXHAUSTED
// Every such call is first tried giving up where it would wait (kvcache::NoWaitScope): only calls
// that must wait take a control thread, so calls that need not never queue behind them. One of at
// most kTryInlineBytes is tried on gRPC's thread; a larger one (a prefix, an append of many rows:
// copies of milliseconds, too long for gRPC's few threads) on kTryThreads of the server's own.
constexpr int64_t kTryInlineBytes = int64_t{1} << 20;
constexpr int kTryThreads = 4;
constexpr int kTryQueue = 1024;  // large calls waiting for those threads; more: RESOURCE_EXHAUSTED

absl::Status ControlQueueFull() {
  return absl::ResourceExhaustedError(absl::StrCat(
      kControlQueue, " Sequences calls wait already (Create, Append, Truncate); retry later"));
}
absl::Status TryQueueFull() {
  return absl::ResourceExhaustedError(
      absl::StrCat(kTryQueue, " Sequences calls of over ", kTryInlineBytes,
                   " bytes wait already to be tried (Create, Append, Truncate); retry later"));
}

// What a control call's work may use of its gRPC call: its deadline, and whether the client is
// still there.
struct CallBounds {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
};

absl::Status Disabled() {
  return absl::FailedPreconditionError(
      "this server runs without a KV cache: start it with --kv_cache_bytes > 0");
}

// Names the missing ids of a NOT_FOUND in trailing metadata (the well-formed ones), when they fit
// beside the message (grpc_status.h) in a client's default 8 KiB of trailers: 108 ids (32 bytes
// and a comma each). More are left out, and the client treats every id of the call as missing (a
// restart loses them all).
constexpr size_t kMaxMissingIdsMetadataBytes = 3584;
void AddMissing(grpc::CallbackServerContext* context, const absl::Status& status) {
  const std::string ids = kvcache::MissingSequenceIdList(status);
  if (!ids.empty() && ids.size() <= kMaxMissingIdsMetadataBytes)
    context->AddTrailingMetadata(kMissingSequenceIdsKey, ids);
}

// An Attend's messages, from its arrival until its answer is serialized.
struct AttendState {
  v1::AttendRequest request;
  v1::AttendResponse response;
};

// A DecodeStep's messages (on one arena: a 64-item step is ~1,000 submessages) and the buffer its
// outputs are sent from, from its arrival until its answer is handed to gRPC.
struct DecodeStepState {
  explicit DecodeStepState(size_t payload_bytes) : arena(DecodeStepArenaOptions(payload_bytes)) {}
  google::protobuf::Arena arena;
  v1::DecodeStepRequest* request =
      google::protobuf::Arena::CreateMessage<v1::DecodeStepRequest>(&arena);
  v1::DecodeStepResponse* response =
      google::protobuf::Arena::CreateMessage<v1::DecodeStepResponse>(&arena);
  AnswerPlace answer;
};

// The sequence id a call's failure log line names (none for the calls of many or no sequences).
std::string_view SequenceIdOf(const v1::AppendRequest& request) { return request.sequence_id(); }
std::string_view SequenceIdOf(const v1::GetSequenceInfoRequest& request) {
  return request.sequence_id();
}
template <typename Request>
std::string_view SequenceIdOf(const Request& /*request*/) {
  return {};
}

using S = v1::Sequences;
using SequencesBase =
    Wrapped<S::Service, S::WithRawCallbackMethod_CreateSequence, S::WithRawCallbackMethod_Append,
            S::WithRawCallbackMethod_Truncate, S::WithRawCallbackMethod_Attend,
            S::WithRawCallbackMethod_DecodeStep, S::WithRawCallbackMethod_Release,
            S::WithRawCallbackMethod_GetSequenceInfo, S::WithRawCallbackMethod_GetKvPoolInfo>;

// Every method is raw (its bytes in and out; grpc_call.h says why): a DecodeStep's answer is sent
// as slices of the buffer its outputs were computed into (edge/grpc/answer_slices.h), not copied
// into a message first.
class SequencesService final : public SequencesBase {
 public:
  SequencesService(AttentionRuntime* runtime, SequenceRuntime* sequences,
                   HeapRetention* heap_retention)
      : runtime_(runtime), sequences_(sequences), heap_retention_(heap_retention) {}

  using Raw = grpc::ByteBuffer;

  grpc::ServerUnaryReactor* CreateSequence(grpc::CallbackServerContext* context, const Raw* request,
                                           Raw* response) override {
    return Queued<v1::CreateSequenceRequest, v1::CreateSequenceResponse>(
        context, grpc_methods::kCreateSequence, *request, response, &SequencesService::DoCreate);
  }

  grpc::ServerUnaryReactor* Append(grpc::CallbackServerContext* context, const Raw* request,
                                   Raw* response) override {
    return Queued<v1::AppendRequest, v1::AppendResponse>(context, grpc_methods::kAppend, *request,
                                                         response, &SequencesService::DoAppend);
  }

  grpc::ServerUnaryReactor* Truncate(grpc::CallbackServerContext* context, const Raw* request,
                                     Raw* response) override {
    return Queued<v1::TruncateRequest, v1::TruncateResponse>(
        context, grpc_methods::kTruncate, *request, response, &SequencesService::DoTruncate);
  }

  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context, const Raw* request,
                                   Raw* response) override;
  grpc::ServerUnaryReactor* DecodeStep(grpc::CallbackServerContext* context, const Raw* request,
                                       Raw* response) override;

  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context, const Raw* request,
                                    Raw* response) override {
    return Inline<v1::ReleaseRequest, v1::ReleaseResponse>(
        context, grpc_methods::kRelease, *request, response, &SequencesService::DoRelease);
  }

  grpc::ServerUnaryReactor* GetSequenceInfo(grpc::CallbackServerContext* context,
                                            const Raw* request, Raw* response) override {
    return Inline<v1::GetSequenceInfoRequest, v1::SequenceInfo>(
        context, grpc_methods::kGetSequenceInfo, *request, response, &SequencesService::DoInfo);
  }

  grpc::ServerUnaryReactor* GetKvPoolInfo(grpc::CallbackServerContext* context, const Raw* request,
                                          Raw* response) override {
    return Inline<v1::GetKvPoolInfoRequest, v1::KvPoolInfo>(
        context, grpc_methods::kGetKvPoolInfo, *request, response, &SequencesService::DoPoolInfo);
  }

 private:
  // The failure log line names the call's sequence id (if it has one; escaped); a NOT_FOUND's
  // well-formed missing ids go into the trailing metadata. The request's size goes to heap
  // retention as an Attention request's does (memory/heap_retention.h): a CreateSequence / Append
  // of >= 16 MiB (an 8k-token prefix of a Llama-3-8B-like layer is 32 MiB) keeps malloc's heap.
  template <typename Request, typename Response>
  using Run = absl::Status (SequencesService::*)(const Request&, Response*, const CallBounds&);

  // A control call that may wait (Create, Append, Truncate): admitted and its bytes counted
  // against --max_inflight_bytes at arrival (so a drain waits for it; refused at once when either
  // fails, or when its queue is full), both held until it is answered; recorded from its arrival
  // to the answer. Tried without waiting first (kTryInlineBytes), then on a control thread. One
  // whose client left or whose deadline passed while it was queued is answered so without running.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Queued(grpc::CallbackServerContext* context, const GrpcMethod& method,
                                   const Raw& raw_request, Raw* raw_response,
                                   Run<Request, Response> run) {
    if (heap_retention_ != nullptr) heap_retention_->Observe(int64_t(raw_request.Length()));
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    auto call = std::make_shared<GrpcCall>(runtime_->metrics(), method);
    call->Start(int64_t(raw_request.Length()));
    auto admission = std::make_shared<Admission>(runtime_->Admit());
    auto hold = std::make_shared<CallHold>();
    absl::Status refused =
        *admission ? absl::OkStatus() : absl::UnavailableError("server shutting down");
    if (refused.ok()) refused = hold->Reserve(runtime_, int64_t(raw_request.Length()));
    if (!refused.ok()) {
      FinishUnary(reactor, call.get(), refused, Response(), raw_response);
      return reactor;
    }
    // On a control thread, waiting if it must. Its copies hold the admission and the bytes.
    const std::function<void()> serve = [this, context, reactor, call, admission, hold,
                                         &raw_request, raw_response, run] {
      const CallBounds bounds{ToAbslTime(context->deadline()),
                              [context] { return context->IsCancelled(); }};
      RunGuarded<Request, Response>(context, reactor, call.get(), raw_request, raw_response,
                                    [&](const Request& request, Response* response) {
                                      absl::Status status = StaleControlCall(bounds);
                                      if (status.ok())
                                        status = (this->*run)(request, response, bounds);
                                      return status;
                                    });
    };
    const std::function<void()> try_first = [this, context, reactor, call, &raw_request,
                                             raw_response, run, serve] {
      if (!TriedWithoutWaiting<Request, Response>(context, reactor, call.get(), raw_request,
                                                  raw_response, run)) {
        SubmitOrRefuse<Response>(&control_, serve, &ControlQueueFull, reactor, call.get(),
                                 raw_response);
      }
    };
    if (int64_t(raw_request.Length()) <= kTryInlineBytes) {
      try_first();
    } else {
      SubmitOrRefuse<Response>(&tries_, try_first, &TryQueueFull, reactor, call.get(),
                               raw_response);
    }
    return reactor;
  }

  // Queues a copy of `task` (which answers the call) on `queue`, else answers RESOURCE_EXHAUSTED:
  // answered either way. The caller's `task` keeps what it holds until the refusal is answered.
  template <typename Response>
  void SubmitOrRefuse(WorkQueue* queue, const std::function<void()>& task, absl::Status (*full)(),
                      grpc::ServerUnaryReactor* reactor, GrpcCall* call, Raw* raw_response) {
    absl::Status refused;
    try {  // copying `task` allocates: on a pool thread nothing else would answer
      if (queue->TrySubmit(task)) return;
      refused = full();
    } catch (const std::bad_alloc&) {
      refused = absl::ResourceExhaustedError("out of memory while queueing the call");
    }
    FinishUnary(reactor, call, refused, Response(), raw_response);
  }

  // Runs a Queued call on this thread unless it would wait (then nothing was done: false, not
  // answered); true once answered. A stale one (it may have queued for kTryThreads) is answered
  // so without running.
  template <typename Request, typename Response>
  bool TriedWithoutWaiting(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                           GrpcCall* call, const Raw& raw_request, Raw* raw_response,
                           Run<Request, Response> run) {
    const CallBounds bounds{ToAbslTime(context->deadline()),
                            [context] { return context->IsCancelled(); }};
    absl::Status thrown;
    try {  // as RunGuarded: answered exactly once whatever throws
      Request request;
      Response response;
      absl::Status status = ParseRequest(raw_request, &request);
      if (status.ok()) status = StaleControlCall(bounds);
      {
        kvcache::NoWaitScope no_wait;
        if (status.ok()) status = (this->*run)(request, &response, bounds);
        if (no_wait.would_have_waited()) return false;
      }
      call->set_session_id(SequenceIdOf(request));
      AddMissing(context, status);
      FinishUnary(reactor, call, status, response, raw_response);
      return true;
    } catch (const std::bad_alloc&) {
      thrown = absl::ResourceExhaustedError("out of memory while serving the call");
    } catch (const std::exception& e) {
      thrown = absl::InternalError(absl::StrCat("the call failed: ", e.what()));
    }
    FinishUnary(reactor, call, thrown, Response(), raw_response);
    return true;
  }

  // A control call that never waits (Release, GetSequenceInfo, GetKvPoolInfo), answered on
  // gRPC's thread: it must not queue behind calls that wait.
  template <typename Request, typename Response>
  grpc::ServerUnaryReactor* Inline(grpc::CallbackServerContext* context, const GrpcMethod& method,
                                   const Raw& raw_request, Raw* raw_response,
                                   Run<Request, Response> run) {
    GrpcCall call(runtime_->metrics(), method);
    call.Start(int64_t(raw_request.Length()));
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    const CallBounds bounds{ToAbslTime(context->deadline()), {}};
    RunGuarded<Request, Response>(context, reactor, &call, raw_request, raw_response,
                                  [&](const Request& request, Response* response) {
                                    return (this->*run)(request, response, bounds);
                                  });
    return reactor;
  }

  // Parses, runs `body` and answers through `reactor`, exactly once whatever `body` throws (a
  // control thread has no handler that would answer for it: gRPC's shutdown would wait forever).
  template <typename Request, typename Response, typename Body>
  void RunGuarded(grpc::CallbackServerContext* context, grpc::ServerUnaryReactor* reactor,
                  GrpcCall* call, const Raw& raw_request, Raw* raw_response, Body&& body) {
    absl::Status thrown;
    try {
      RunUnary<Request, Response>(
          reactor, call, raw_request, raw_response,
          [&](const Request& request, Response* response, GrpcCall* answered) {
            answered->set_session_id(SequenceIdOf(request));
            absl::Status status = body(request, response);
            AddMissing(context, status);
            return status;
          });
      return;
    } catch (const std::bad_alloc&) {
      thrown = absl::ResourceExhaustedError("out of memory while serving the call");
    } catch (const std::exception& e) {
      thrown = absl::InternalError(absl::StrCat("the call failed: ", e.what()));
    }
    FinishUnary(reactor, call, thrown, Response(), raw_response);
  }

  // CANCELLED / DEADLINE_EXCEEDED for a queued call nobody waits for any more.
  static absl::Status StaleControlCall(const CallBounds& bounds) {
    if (bounds.cancelled()) return absl::CancelledError("the call was cancelled before it ran");
    if (absl::Now() > bounds.deadline) {
      return absl::DeadlineExceededError("deadline passed while the call waited to run");
    }
    return absl::OkStatus();
  }
  absl::Status DoCreate(const v1::CreateSequenceRequest& request,
                        v1::CreateSequenceResponse* response, const CallBounds& bounds);
  absl::Status DoAppend(const v1::AppendRequest& request, v1::AppendResponse* response,
                        const CallBounds& bounds);
  absl::Status DoTruncate(const v1::TruncateRequest& request, v1::TruncateResponse* response,
                          const CallBounds& bounds);
  absl::Status DoRelease(const v1::ReleaseRequest& request, v1::ReleaseResponse* response,
                         const CallBounds& bounds);
  absl::Status DoInfo(const v1::GetSequenceInfoRequest& request, v1::SequenceInfo* response,
                      const CallBounds& bounds);
  absl::Status DoPoolInfo(const v1::GetKvPoolInfoRequest& request, v1::KvPoolInfo* response,
                          const CallBounds& bounds);
  // What a decode call's answer keeps while gRPC writes it: its admission, so that a drain waits
  // for the answer to be written (a DecodeStep's answer slices hold it).
  using AnswerHold = std::shared_ptr<void>;
  // Admits a built decode call and hands it to the SequenceRuntime; `fill` writes the answer on
  // success and returns its size. Answers the gRPC call exactly once, maybe inline.
  // `bytes` are counted against --max_inflight_bytes (into `hold`) before `build` runs.
  grpc::ServerUnaryReactor* Launch(
      grpc::CallbackServerContext* context, std::shared_ptr<GrpcCall> grpc_call, int64_t bytes,
      std::shared_ptr<CallHold> hold,
      const std::function<absl::StatusOr<std::shared_ptr<DecodeCall>>()>& build,
      std::function<absl::StatusOr<int64_t>(const DecodeReport&, AnswerHold)> fill);

  AttentionRuntime* const runtime_;
  SequenceRuntime* const sequences_;
  HeapRetention* const heap_retention_;  // may be null
  // Last: destroyed first, running what is queued while the rest is still there (gRPC has
  // finished every call by then: its Shutdown waits for them); tries_ before control_, which its
  // tasks may queue into.
  WorkQueue control_{kControlThreads, kControlQueue};
  WorkQueue tries_{kTryThreads, kTryQueue};
};

grpc::ServerUnaryReactor* SequencesService::Launch(
    grpc::CallbackServerContext* context, std::shared_ptr<GrpcCall> grpc_call, int64_t bytes,
    std::shared_ptr<CallHold> hold,
    const std::function<absl::StatusOr<std::shared_ptr<DecodeCall>>()>& build,
    std::function<absl::StatusOr<int64_t>(const DecodeReport&, AnswerHold)> fill) {
  LiveUnaryReactor* reactor = new LiveUnaryReactor();  // deletes itself (OnDone)
  auto admission = std::make_shared<Admission>(runtime_->Admit());
  absl::Status refused = sequences_ == nullptr ? Disabled() : absl::OkStatus();
  if (refused.ok() && !*admission) refused = absl::UnavailableError("server shutting down");
  if (refused.ok()) refused = hold->Reserve(runtime_, bytes);
  absl::StatusOr<std::shared_ptr<DecodeCall>> built =
      refused.ok() ? build() : absl::StatusOr<std::shared_ptr<DecodeCall>>(refused);
  if (!built.ok()) {
    // Before the answer (`build` still holds `hold`); nothing was appended yet.
    hold->shm.ReleaseLeases().IgnoreError();
    hold.reset();  // and the bytes
    reactor->Finish(grpc_call->Finish(built.status()));
    return reactor;
  }
  std::shared_ptr<DecodeCall> call = *std::move(built);
  call->received = grpc_call->started();
  call->deadline = ToAbslTime(context->deadline());
  call->cancelled = [context] { return context->IsCancelled(); };
  kvcache::SequenceCache* cache = &sequences_->cache();
  call->done = [reactor, context, grpc_call, admission, cache, fill = std::move(fill),
                hold = std::move(hold)](const absl::Status& status,
                                        const DecodeReport& report) mutable {
    absl::Status answered = status;
    hold->shm.KeepAppended(report);
    if (answered.ok()) {
      absl::StatusOr<int64_t> sent = fill(report, admission);
      if (sent.ok()) grpc_call->AddBytesOut(*sent);
      answered = sent.status();
    }
    AddMissing(context, answered);
    // O is in place: a client that unregisters after the answer finds no lease (`build` may
    // still hold `hold` when the call ran inline, so the leases go explicitly).
    answered = FinishSequenceShm(std::move(answered), &hold->shm, cache);
    // The bytes stay counted until the answer has left (an unread one is held by gRPC).
    reactor->FinishAnswer(context, std::move(hold), grpc_call->Finish(answered));
    // `admission` is released with this callback, or later with the answer's slices (DecodeStep).
  };
  sequences_->Submit(std::move(call));
  return reactor;
}

grpc::ServerUnaryReactor* SequencesService::Attend(grpc::CallbackServerContext* context,
                                                   const Raw* request_bytes, Raw* response_bytes) {
  auto grpc_call = std::make_shared<GrpcCall>(runtime_->metrics(), grpc_methods::kAttend);
  grpc_call->Start(int64_t(request_bytes->Length()));
  auto state = std::make_shared<AttendState>();
  if (absl::Status parsed = ParseRequest(*request_bytes, &state->request); !parsed.ok()) {
    return AnswerUnary(context, grpc_call.get(), parsed, state->response, response_bytes);
  }
  grpc_call->set_session_id(state->request.sequence_id());
  const absl::Time received = grpc_call->started();
  return Launch(
      context, grpc_call, AttendBytes(state->request), std::make_shared<CallHold>(),
      [state] { return BuildAttend(state->request, &state->response); },
      [state, received, response_bytes](const DecodeReport& report,
                                        AnswerHold) -> absl::StatusOr<int64_t> {
        // One item's O (up to 8 MiB) serialized into the answer: its admission ends with the done
        // callback; the reactor keeps the call live until the answer is written (LiveUnaryReactor).
        FillAttend(report, received, &state->response);
        if (absl::Status s = SerializeAnswer(state->response, response_bytes); !s.ok()) return s;
        return int64_t(response_bytes->Length());
      });
}

grpc::ServerUnaryReactor* SequencesService::DecodeStep(grpc::CallbackServerContext* context,
                                                       const Raw* request_bytes,
                                                       Raw* response_bytes) {
  auto grpc_call = std::make_shared<GrpcCall>(runtime_->metrics(), grpc_methods::kDecodeStep);
  grpc_call->Start(int64_t(request_bytes->Length()));
  auto state = std::make_shared<DecodeStepState>(request_bytes->Length());
  if (absl::Status parsed = ParseRequest(*request_bytes, state->request); !parsed.ok()) {
    return AnswerUnary(context, grpc_call.get(), parsed, *state->response, response_bytes);
  }
  // A q in a region makes an O of its size in the answer, past what its message bounds: one that
  // gRPC could not send is refused before anything is sized from it (a call alone is always
  // admitted under --max_inflight_bytes).
  const int64_t step_bytes = DecodeStepBytes(*state->request);
  if (const int64_t answer = step_bytes - int64_t(state->request->ByteSizeLong());
      answer > kMaxInlineAnswerBytes) {
    return AnswerUnary(
        context, grpc_call.get(),
        absl::ResourceExhaustedError(absl::StrCat(
            "the answer would carry up to ", answer,
            " bytes of O and LSE; a gRPC message holds at most ", kMaxInlineAnswerBytes,
            ": write them into shared-memory regions (out_shm, lse_shm)")),
        *state->response, response_bytes);
  }
  // Only steps that can run keep the heap (a malformed one, or one on a server without a KV cache,
  // held it 10 s each: a 1-byte call every few seconds kept freed heap forever).
  if (heap_retention_ != nullptr && sequences_ != nullptr) heap_retention_->Retain();
  state->answer.pool = runtime_->backend().staging_pool();
  const int max_items = sequences_ == nullptr ? 0 : sequences_->options().max_batch_sequences;
  const absl::Time received = grpc_call->started();
  auto hold = std::make_shared<CallHold>();
  InitSequenceShm(runtime_->shm_regions(), sequences_, &hold->shm);
  return Launch(
      context, grpc_call, step_bytes, hold,
      [state, max_items, hold] {
        return BuildDecodeStep(*state->request, max_items, &hold->shm, state->response,
                               &state->answer);
      },
      [state, received, response_bytes](const DecodeReport& report,
                                        AnswerHold admission) -> absl::StatusOr<int64_t> {
        FillDecodeStep(report, received, state->response);
        AnswerPieces pieces = EncodeDecodeStepAnswer(state->response, state->answer.buffer.get());
        const auto bytes = int64_t(pieces.total_bytes);
        *response_bytes =
            AnswerByteBuffer(std::move(pieces), state->answer.buffer, std::move(admission));
        return bytes;
      });
}

absl::Status SequencesService::DoCreate(const v1::CreateSequenceRequest& request,
                                        v1::CreateSequenceResponse* response,
                                        const CallBounds& bounds) {
  if (sequences_ == nullptr) return Disabled();  // after the parse: a malformed call says so
  absl::StatusOr<kvcache::CreateRequest> create = CreateRequestFrom(request);
  if (!create.ok()) return create.status();
  absl::StatusOr<kvcache::SequenceStatus> created =
      sequences_->cache().CreateSequence(*create, bounds.deadline, bounds.cancelled);
  if (!created.ok()) return created.status();
  response->set_sequence_id(created->id);
  response->set_ttl_ms(absl::ToInt64Milliseconds(sequences_->options().cache.ttl));
  response->set_max_tokens(created->max_tokens);
  for (int64_t length : created->lengths) response->add_layer_lengths(length);
  response->set_already_created(created->already_created);
  return absl::OkStatus();
}

absl::Status SequencesService::DoAppend(const v1::AppendRequest& request,
                                        v1::AppendResponse* response, const CallBounds& bounds) {
  if (sequences_ == nullptr) return Disabled();  // after the parse: a malformed call says so
  std::vector<kvcache::LayerRows> rows;
  for (const v1::LayerKV& layer : request.rows()) {
    absl::StatusOr<kvcache::LayerRows> converted = LayerRowsFrom(layer);
    if (!converted.ok()) return converted.status();
    rows.push_back(*converted);
  }
  absl::StatusOr<kvcache::AppendResult> appended =
      sequences_->cache().Append(request.sequence_id(), rows, bounds.deadline, bounds.cancelled);
  if (!appended.ok()) return appended.status();
  for (int64_t length : appended->lengths) response->add_layer_lengths(length);
  for (int layer : appended->already_appended) response->add_already_appended_layers(layer);
  return absl::OkStatus();
}

absl::Status SequencesService::DoTruncate(const v1::TruncateRequest& request,
                                          v1::TruncateResponse* response,
                                          const CallBounds& bounds) {
  if (sequences_ == nullptr) return Disabled();  // after the parse: a malformed call says so
  // Bounded as a DecodeStep is: the cache's lock is held for the whole list.
  const int max_items = sequences_->options().max_batch_sequences;
  if (request.items_size() > max_items) {
    return absl::InvalidArgumentError(absl::StrCat("a Truncate names at most ", max_items,
                                                   " sequences (--max_batch_sequences), got ",
                                                   request.items_size()));
  }
  std::vector<kvcache::TruncateItem> items;
  items.reserve(size_t(request.items_size()));
  for (const v1::TruncateItem& item : request.items()) {
    items.push_back(
        {item.sequence_id(), item.length(), {item.layers().begin(), item.layers().end()}});
  }
  absl::StatusOr<std::vector<kvcache::TruncateResult>> cut =
      sequences_->cache().Truncate(items, bounds.deadline, bounds.cancelled);
  if (!cut.ok()) return cut.status();
  for (const kvcache::TruncateResult& one : *cut) {
    v1::TruncateResult* result = response->add_results();
    for (int64_t length : one.lengths) result->add_layer_lengths(length);
    result->set_dropped_tokens(one.dropped);
  }
  return absl::OkStatus();
}

absl::Status SequencesService::DoRelease(const v1::ReleaseRequest& request,
                                         v1::ReleaseResponse* response,
                                         const CallBounds& /*bounds*/) {
  if (sequences_ == nullptr) return Disabled();
  // Bounded as a DecodeStep is: the cache's lock is held for the whole list.
  const int max_ids = sequences_->options().max_batch_sequences;
  if (request.sequence_ids_size() > max_ids) {
    return absl::InvalidArgumentError(absl::StrCat("a Release names at most ", max_ids,
                                                   " sequences (--max_batch_sequences), got ",
                                                   request.sequence_ids_size()));
  }
  const std::vector<std::string> ids(request.sequence_ids().begin(), request.sequence_ids().end());
  int64_t released = 0;
  const std::vector<std::string> missing = sequences_->cache().Release(ids, &released);
  response->set_released(int32_t(released));
  for (const std::string& id : missing) response->add_not_found(id);  // well-formed: ours
  return absl::OkStatus();
}

absl::Status SequencesService::DoPoolInfo(const v1::GetKvPoolInfoRequest& /*request*/,
                                          v1::KvPoolInfo* response, const CallBounds& /*bounds*/) {
  response->set_enabled(sequences_ != nullptr);
  if (sequences_ != nullptr) FillPoolInfo(sequences_, response);
  return absl::OkStatus();
}

absl::Status SequencesService::DoInfo(const v1::GetSequenceInfoRequest& request,
                                      v1::SequenceInfo* response, const CallBounds& /*bounds*/) {
  if (sequences_ == nullptr) return Disabled();
  absl::StatusOr<kvcache::SequenceStatus> info = sequences_->cache().Info(request.sequence_id());
  if (!info.ok()) return info.status();
  FillSequenceInfo(*info, response);
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<grpc::Service> CreateSequencesService(AttentionRuntime* runtime,
                                                      SequenceRuntime* sequences,
                                                      HeapRetention* heap_retention) {
  return std::make_unique<SequencesService>(runtime, sequences, heap_retention);
}

}  // namespace flashserve
