#include "edge/grpc/attention_call.h"

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "api/request_wire.h"
#include "api/response_wire.h"
#include "common/logging.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "edge/grpc/read_end.h"
#include "runtime/shm_requests.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

// Requests under this size go to the hot lane and give their receive buffers back right after the
// copy; larger ones run on the gRPC thread and keep their buffers until the call is done.
constexpr int64_t kSmallRequestBytes = int64_t{4} << 20;

// A slice that sends `length` bytes at `data` without copying them and keeps `io` alive until
// gRPC has written them.
grpc::Slice SliceOf(const char* data, size_t length, const std::shared_ptr<IoBuffers>& io) {
  return grpc::Slice(
      const_cast<char*>(data), length,
      [](void* keep) { delete static_cast<std::shared_ptr<IoBuffers>*>(keep); },
      new std::shared_ptr<IoBuffers>(io));
}

// The serialized response: its small fields copied, O and LSE sent from the request's buffers.
grpc::ByteBuffer ResponseBytes(const v1::AttentionResponse& header,
                               const std::shared_ptr<IoBuffers>& io) {
  const IoLayout& layout = io->layout();
  const std::string_view out(io->o(), layout.q_bytes);
  const std::string_view lse(reinterpret_cast<const char*>(io->lse()), layout.lse_bytes);
  const ResponsePieces pieces = EncodeAttentionResponse(header, out, lse);
  grpc::Slice slices[5];
  size_t n = 0;
  slices[n++] = grpc::Slice(pieces.out_prefix);
  slices[n++] = SliceOf(out.data(), out.size(), io);
  if (!lse.empty()) {
    slices[n++] = grpc::Slice(pieces.lse_prefix);
    slices[n++] = SliceOf(lse.data(), lse.size(), io);
  }
  if (!pieces.rest.empty()) slices[n++] = grpc::Slice(pieces.rest);
  return grpc::ByteBuffer(slices, n);
}

grpc::ByteBuffer PlainResponseBytes(const v1::AttentionResponse& response) {
  grpc::Slice slice(response.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

// One Attention call, from its first header to its answer. Deletes itself when gRPC is done.
class AttentionCall final : public grpc::ServerGenericBidiReactor {
 public:
  AttentionCall(AttentionRuntime* runtime, const AttentionCallOptions& options,
                HotLane* hot_lane,
                grpc::GenericCallbackServerContext* context)
      : runtime_(runtime), options_(options), hot_lane_(hot_lane),
        context_(context), call_(runtime->metrics(), grpc_methods::kAttention) {
    // Admitted now, while the request may still be uploading: the shutdown drain waits for it.
    admission_ = runtime_->Admit();
    if (!admission_) {
      Answer(absl::UnavailableError("server is shutting down"));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      EndWithoutRequest();
      return;
    }
    // The server's clock (Timing.total_us, request_duration_seconds) starts with the whole request.
    request_size_ = int64_t(request_.Length());
    call_.Start(request_size_);
    received_ = call_.started();
    if (options_.heap_retention != nullptr) options_.heap_retention->Observe(request_size_);
    if (hot_lane_ != nullptr && request_size_ < kSmallRequestBytes) {
      ServerMetrics* metrics = runtime_->metrics();
      absl::AnyInvocable<void()> process = [this] { Process(); };
      const bool on_lane = hot_lane_->TryRun(process);
      if (metrics != nullptr) metrics->RecordHotLane(on_lane);
      if (on_lane) return;  // `this` may be gone already
    }
    Process();
  }

  void OnWriteDone(bool /*ok*/) override {}
  void OnDone() override {
    // EndWithoutRequest's answer, counted now that gRPC is done with the call: cancelled, it never
    // reached the client, which got gRPC's own RESOURCE_EXHAUSTED.
    if (count_when_done_) {
      call_.Finish(AnsweredCallWasOverSizeLimit(context_) ? OverSizeLimit() : NoMessage());
    }
    delete this;
  }

 private:
  // The read ended without a complete request (edge/grpc/read_end.h); counted as what happened:
  // a broken stream CANCELLED (or DEADLINE_EXCEEDED) -- nobody hears the answer --, a message over
  // --max_request_bytes RESOURCE_EXHAUSTED, a half-close without a complete message
  // INVALID_ARGUMENT, which the client receives. The last two look alike at first: counted in
  // OnDone. (A client that half-closes mid-message and then resets its stream counts as over the
  // limit: it is told nothing either way.)
  void EndWithoutRequest() {
    switch (ClassifyReadEnd(context_)) {
      case ReadEnd::kDeadlinePassed:
        Answer(absl::DeadlineExceededError(
            "flashserve.v1.AttentionRequest: the deadline passed before the request was complete"));
        return;
      case ReadEnd::kStreamBroke:
        Answer(absl::CancelledError(
            "flashserve.v1.AttentionRequest: the stream ended before the request was complete (the "
            "client cancelled or disconnected, or gRPC reset the stream over "
            "--grpc_memory_quota_bytes)"));
        return;
      case ReadEnd::kOverSizeLimit:
        Answer(OverSizeLimit());
        return;
      case ReadEnd::kHalfClosed:
        count_when_done_ = true;
        live_.AnswerHandedOver(context_, nullptr);  // as Answer does: before Finish
        Finish(ToGrpcStatus(NoMessage()));
        return;
    }
  }
  static absl::Status NoMessage() {
    return absl::InvalidArgumentError(
        "flashserve.v1.AttentionRequest: no complete message was received");
  }
  static absl::Status OverSizeLimit() {
    return OverSizeLimitStatus("flashserve.v1.AttentionRequest");
  }

  // Parses the received request and submits it; runs on the gRPC thread or on the hot lane.
  void Process() {
    absl::Status parsed = absl::InvalidArgumentError("flashserve.v1.AttentionRequest: unreadable message");
    if (request_.Dump(&slices_).ok()) {
      std::vector<std::string_view> views;
      views.reserve(slices_.size());
      for (const grpc::Slice& slice : slices_) {
        views.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
      }
      parsed = ParseAttentionRequestWire(views, &wire_);
    }
    request_.Clear();  // slices_ holds the bytes now
    if (!parsed.ok()) {
      Answer(parsed);
      return;
    }
    AttentionRuntime::Call call;
    call.request = &wire_.header;
    call.response = &response_;
    call.received = received_;
    call.deadline = ToAbslTime(context_->deadline());
    call.cancelled = [context = context_] { return context->IsCancelled(); };
    // The tensors stay in gRPC's receive slices (page-locked when they came from the receive
    // arena); the runtime copies them only if the backend cannot read them there.
    for (int i = 0; i < 3; ++i) {
      call.inputs[i] = TensorBytes::FromReceiveBuffers(std::move(wire_.data[i].pieces));
    }
    call.inputs_owner = std::make_shared<std::vector<grpc::Slice>>(std::move(slices_));
    call.outputs_in_buffers = true;  // O and LSE leave as slices of the request buffers
    call.buffers_out = &io_;
    call.answer_keeps_bytes = &answer_bytes_;
    call.max_inline_answer_bytes = kMaxInlineAnswerBytes;
    const ShmReferences shm = NativeShmReferences(wire_.header);
    if (shm.any()) {
      // Shared memory (Triton's extension): an output in a region is not sent, so the response
      // is the plain message (the other output, if any, in its data field).
      shm_outputs_ = shm.any_output();
      call.outputs_in_buffers = !shm_outputs_;
      if (absl::Status s = AttachShm(*runtime_, shm, "", &call, &leases_); !s.ok()) {
        leases_.clear();
        Answer(s);
        return;
      }
    }
    if (options_.fault_injection) call.inject = InjectedFaultFor(wire_.header.request_id());
    call.done = [this](const absl::Status& status) {
      // The output is in its region: the client may unregister now.
      Answer(ReleaseShmLeases(status, &leases_));
    };
    runtime_->Submit(std::move(call), std::move(admission_));
  }

  // Sends the response (or the error) through the call's GrpcCall; called exactly once.
  void Answer(const absl::Status& status) {
    if (status.ok()) {
      response_bytes_ = shm_outputs_ || io_ == nullptr ? PlainResponseBytes(response_)
                                                       : ResponseBytes(response_, io_);
      call_.AddBytesOut(int64_t(response_bytes_.Length()));
    }
    const std::string& request_id = wire_.header.request_id();
    call_.set_request_id(request_id);
    if (status.ok() && spdlog::should_log(spdlog::level::debug)) {
      const v1::Timing& t = response_.timing();
      spdlog::debug(
          "Attention ok: request_id=\"{}\" kernel={} total_us={} queue_us={} stage_us={} h2d_us={} "
          "compute_us={} d2h_us={}",
          LogSafe(request_id), response_.kernel(), t.total_us(), t.queue_us(), t.stage_us(),
          t.h2d_us(), t.compute_us(), t.d2h_us());
    }
    // Before the answer goes out: once it has, gRPC may delete `this` at any moment.
    const grpc::Status finished = call_.Finish(status);
    live_.AnswerHandedOver(context_, std::move(answer_bytes_));
    if (status.ok()) {
      StartWriteAndFinish(&response_bytes_, grpc::WriteOptions(), finished);
    } else {
      Finish(finished);
    }
  }

  AttentionRuntime* const runtime_;
  const AttentionCallOptions& options_;
  HotLane* const hot_lane_;  // null: no lane
  grpc::GenericCallbackServerContext* const context_;
  LiveCall live_;  // until gRPC has finished the call (deletes this)
  AttentionRuntime::Admission admission_;
  grpc::ByteBuffer request_;
  std::vector<grpc::Slice> slices_;  // the request's bytes, referenced (not copied)
  WireRequest wire_;
  v1::AttentionResponse response_;
  std::shared_ptr<IoBuffers> io_;
  std::shared_ptr<void> answer_bytes_;  // the call's --max_inflight_bytes, until gRPC is done
  ShmLeases leases_;          // regions the request names (given back before the answer)
  bool shm_outputs_ = false;  // O or LSE goes into a region: the response is the plain message
  grpc::ByteBuffer response_bytes_;
  absl::Time received_ = absl::InfinitePast();
  int64_t request_size_ = 0;
  bool count_when_done_ = false;  // EndWithoutRequest answered; OnDone counts the call
  GrpcCall call_;  // metrics, failure log, status conversion
};

}  // namespace

AttentionRouter::AttentionRouter(AttentionRuntime* runtime, const AttentionCallOptions& options)
    : runtime_(runtime),
      options_(options),
      hot_lane_(options.hot_lane_spin_us > 0
                    ? std::make_unique<HotLane>(absl::Microseconds(options.hot_lane_spin_us))
                    : nullptr) {}

grpc::ServerGenericBidiReactor* AttentionRouter::CreateReactor(
    grpc::GenericCallbackServerContext* context) {
  if (context->method() == grpc_methods::kAttention.path) {
    return new AttentionCall(runtime_, options_, hot_lane_.get(), context);
  }
  return grpc::CallbackGenericService::CreateReactor(context);  // UNIMPLEMENTED
}

}  // namespace flashserve
