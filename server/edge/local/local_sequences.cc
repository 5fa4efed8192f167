// The local socket's DecodeStep and Attend: edge/grpc/sequences_service.cc's Launch, with the
// connection's thread waiting for done() instead of a gRPC reactor.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/protobuf_errors.h"
#include "common/utf8.h"
#include "edge/local/call_waiter.h"
#include "edge/local/local_calls.h"
#include "edge/sequences/sequences_arena.h"
#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_hold.h"

namespace flashserve {
namespace {

using BuildFn = std::function<absl::StatusOr<std::shared_ptr<DecodeCall>>()>;

// A DecodeStep's or Attend's state, kept past its answer (LocalReply::after_write). Destroyed in
// reverse: the call record (it points into the request), the hold, the arena, then the admission
// (the drain waits for the answer to be written).
struct DecodeState {
  explicit DecodeState(size_t payload_bytes) : arena(DecodeStepArenaOptions(payload_bytes)) {}
  AttentionRuntime::Admission admission;
  google::protobuf::Arena arena;
  CallHold hold;
  // Where the outputs the answer's pieces point into are (edge/sequences/answer_buffer.h).
  AnswerPlace answer;
  std::shared_ptr<DecodeCall> call;
};

// gRPC names the ids of a NOT_FOUND in trailing metadata; a frame has only its message, so they
// are appended to it: "...; missing sequence ids: a,b". All or none: an error frame's message is
// cut at kMaxErrorMessageBytes, and a list cut short would read as every missing id (the client
// re-created only some of its lost sequences). Without the list the client treats every id of
// the call as missing, as over gRPC when they do not fit its trailers.
absl::Status WithMissingIds(const absl::Status& status) {
  const std::string ids = kvcache::MissingSequenceIdList(status);
  constexpr absl::string_view kMarker = "; missing sequence ids: ";
  if (ids.empty() ||
      status.message().size() + kMarker.size() + ids.size() > kMaxErrorMessageBytes) {
    return status;
  }
  return absl::Status(status.code(), absl::StrCat(status.message(), kMarker, ids));
}

// Reserves `bytes`, builds the call, submits it and waits for its answer; OK when `fill` ran.
// The call record stays in `state` (freed after the answer is written).
absl::Status RunDecode(const LocalServices& services, LocalCall& local, int64_t bytes,
                       DecodeState* state, const BuildFn& build,
                       const std::function<void(const DecodeReport&)>& fill) {
  CallHold* hold = &state->hold;
  if (services.sequences == nullptr) {
    return absl::FailedPreconditionError(
        "this server runs without a KV cache: start it with --kv_cache_bytes > 0");
  }
  if (!local.admission) return absl::UnavailableError("server shutting down");
  if (absl::Status s = hold->Reserve(services.runtime, bytes); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<DecodeCall>> built = build();
  if (!built.ok()) return built.status();
  std::shared_ptr<DecodeCall> call = *std::move(built);
  state->call = call;
  call->received = local.received;
  call->cancelled = std::move(local.peer_gone);
  call->caller_waits = true;  // this thread waits for done(): run the call here, no worker hop
  auto waiter = std::make_shared<CallWaiter>();
  absl::Status done_status;
  call->done = [waiter, &done_status, &fill, hold](const absl::Status& status,
                                                   const DecodeReport& report) {
    hold->shm.KeepAppended(report);
    if (status.ok()) fill(report);
    done_status = status;
    waiter->Notify();
  };
  services.sequences->Submit(std::move(call));
  waiter->Wait(services.spin);
  return WithMissingIds(done_status);
}

// Runs RunDecode on `state`, then gives the regions back (before the answer: a client that
// unregisters after its answer finds no lease) and keeps the rest for after the answer.
absl::Status RunAndKeep(const LocalServices& services, LocalCall& local, int64_t bytes,
                        std::shared_ptr<DecodeState> state, const BuildFn& build,
                        const std::function<void(const DecodeReport&)>& fill, LocalReply* reply) {
  absl::Status status = RunDecode(services, local, bytes, state.get(), build, fill);
  status =
      FinishSequenceShm(std::move(status), &state->hold.shm,
                        services.sequences == nullptr ? nullptr : &services.sequences->cache());
  state->admission = std::move(local.admission);
  reply->after_write = std::move(state);
  return status;
}

}  // namespace

void ServeLocalDecodeStep(const LocalServices& services, LocalCall local, LocalReply* reply) {
  auto state = std::make_shared<DecodeState>(local.payload.size());
  google::protobuf::Arena& arena = state->arena;
  auto& request = *google::protobuf::Arena::CreateMessage<v1::DecodeStepRequest>(&arena);
  reply->status = ParseMessage(local.payload, &request);
  if (!reply->status.ok()) return;
  // Only steps that can run keep the heap (a malformed one, or one on a server without a KV cache,
  // held it 10 s each: a 1-byte call every few seconds kept freed heap forever).
  if (services.heap_retention != nullptr && services.sequences != nullptr)
    services.heap_retention->Retain();
  auto& response = *google::protobuf::Arena::CreateMessage<v1::DecodeStepResponse>(&arena);
  const int max_items =
      services.sequences == nullptr ? 0 : services.sequences->options().max_batch_sequences;
  SequenceShm* shm = &state->hold.shm;
  InitSequenceShm(services.runtime->shm_regions(), services.sequences, shm);
  AnswerPlace* answer = &state->answer;
  answer->pool = services.runtime->backend().staging_pool();
  const absl::Time received = local.received;
  reply->status = RunAndKeep(
      services, local, DecodeStepBytes(request), std::move(state),
      [&] { return BuildDecodeStep(request, max_items, shm, &response, answer); },
      [&](const DecodeReport& report) { FillDecodeStep(report, received, &response); }, reply);
  if (!reply->status.ok()) return;
  // O and LSE are written from the answer buffer where they were computed (no copy).
  AnswerPieces pieces = EncodeDecodeStepAnswer(&response, answer->buffer.get());
  reply->bytes = std::move(pieces.header);
  for (const AnswerPieces::Piece& piece : pieces.pieces) {
    reply->AddPiece(AnswerPieces::View(piece, reply->bytes, answer->buffer.get()));
  }
}

void ServeLocalAttend(const LocalServices& services, LocalCall local, LocalReply* reply) {
  v1::AttendRequest request;
  reply->status = ParseMessage(local.payload, &request);
  if (!reply->status.ok()) return;
  v1::AttendResponse response;
  const absl::Time received = local.received;
  reply->status = RunAndKeep(
      services, local, AttendBytes(request), std::make_shared<DecodeState>(0),
      [&] { return BuildAttend(request, &response); },
      [&](const DecodeReport& report) { FillAttend(report, received, &response); }, reply);
  if (!reply->status.ok()) return;
  reply->bytes = response.SerializeAsString();
  reply->AddPiece(reply->bytes);
}

}  // namespace flashserve
