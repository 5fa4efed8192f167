// The local socket's DecodeStep and Attend: edge/grpc/sequences_service.cc's Launch, with the
// connection's thread waiting for done() instead of a gRPC reactor.
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "edge/sequences/sequences_arena.h"
#include "edge/sequences/sequences_decode.h"
#include "edge/sequences/sequences_hold.h"
#include "edge/local/call_waiter.h"
#include "edge/local/local_calls.h"

namespace flashserve {
namespace {

using BuildFn = std::function<absl::StatusOr<std::shared_ptr<DecodeCall>>()>;

// gRPC names the ids of a NOT_FOUND in trailing metadata; a frame has only its message, so they
// are appended to it: "...; missing sequence ids: a,b".
absl::Status WithMissingIds(const absl::Status& status, const std::string& first_id) {
  if (status.code() != absl::StatusCode::kNotFound) return status;
  std::vector<std::string> ids = kvcache::MissingSequenceIds(status);
  const std::string joined = ids.empty() ? first_id : absl::StrJoin(ids, ",");
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), "; missing sequence ids: ", joined));
}

// Reserves `bytes`, builds the call, submits it and waits for its answer; OK when `fill` ran.
absl::Status RunDecode(const LocalServices& services, LocalCall& local, int64_t bytes,
                       CallHold* hold, const BuildFn& build,
                       const std::function<void(const DecodeReport&)>& fill) {
  if (services.sequences == nullptr) {
    return absl::FailedPreconditionError(
        "this server runs without a KV cache: start it with --kv_cache_bytes > 0");
  }
  if (!local.admission) return absl::UnavailableError("server shutting down");
  if (absl::Status s = hold->Reserve(services.runtime, bytes); !s.ok()) return s;
  absl::StatusOr<std::shared_ptr<DecodeCall>> built = build();
  if (!built.ok()) return built.status();
  std::shared_ptr<DecodeCall> call = *std::move(built);
  call->received = local.received;
  call->cancelled = std::move(local.peer_gone);
  call->caller_waits = true;  // this thread waits for done(): run the call here, no worker hop
  const std::string first_id = call->items.empty() ? "" : call->items[0].id;
  auto waiter = std::make_shared<CallWaiter>();
  absl::Status done_status;
  call->done = [waiter, &done_status, &fill](const absl::Status& status,
                                             const DecodeReport& report) {
    if (status.ok()) fill(report);
    done_status = status;
    waiter->Notify();
  };
  services.sequences->Submit(std::move(call));
  waiter->Wait(services.spin);
  return WithMissingIds(done_status, first_id);
  // `local.admission` is released by the caller after the answer is written: the drain waits.
}

}  // namespace

void ServeLocalDecodeStep(const LocalServices& services, LocalCall local, LocalReply* reply) {
  google::protobuf::Arena arena(DecodeStepArenaOptions(local.payload.size()));
  auto& request = *google::protobuf::Arena::CreateMessage<v1::DecodeStepRequest>(&arena);
  if (!request.ParseFromArray(local.payload.data(), int(local.payload.size()))) {
    reply->status = absl::InvalidArgumentError("DecodeStepRequest: unreadable message");
    return;
  }
  auto& response = *google::protobuf::Arena::CreateMessage<v1::DecodeStepResponse>(&arena);
  const int max_items =
      services.sequences == nullptr ? 0 : services.sequences->options().max_batch_sequences;
  CallHold hold;
  InitSequenceShm(services.runtime->shm_regions(), services.sequences, &hold.shm);
  const absl::Time received = local.received;
  reply->status = RunDecode(
      services, local, DecodeStepBytes(request), &hold,
      [&] { return BuildDecodeStep(request, max_items, &hold.shm, &response); },
      [&](const DecodeReport& report) { FillDecodeStep(report, received, &response); });
  if (!reply->status.ok()) return;
  reply->bytes = response.SerializeAsString();
  reply->AddPiece(reply->bytes);
}

void ServeLocalAttend(const LocalServices& services, LocalCall local, LocalReply* reply) {
  v1::AttendRequest request;
  if (!request.ParseFromArray(local.payload.data(), int(local.payload.size()))) {
    reply->status = absl::InvalidArgumentError("AttendRequest: unreadable message");
    return;
  }
  v1::AttendResponse response;
  CallHold hold;
  const absl::Time received = local.received;
  reply->status = RunDecode(
      services, local, AttendBytes(request), &hold,
      [&] { return BuildAttend(request, &response); },
      [&](const DecodeReport& report) { FillAttend(report, received, &response); });
  if (!reply->status.ok()) return;
  reply->bytes = response.SerializeAsString();
  reply->AddPiece(reply->bytes);
}

}  // namespace flashserve
