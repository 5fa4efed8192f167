#include "edge/grpc/stream_edge.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "edge/grpc/grpc_call.h"
#include "edge/grpc/grpc_status.h"
#include "edge/grpc/live_calls.h"
#include "edge/grpc/stream_transfer.h"
#include "flashserve/v1/attention.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace flashserve {

namespace {

// Every method is raw (its bytes in and out): grpc_call.h says why.
using Stream = v1::AttentionStreamService;
using StreamServiceBase =
    Wrapped<Stream::Service, Stream::WithRawCallbackMethod_OpenSession,
            Stream::WithRawCallbackMethod_Upload, Stream::WithRawCallbackMethod_Compute,
            Stream::WithRawCallbackMethod_Download, Stream::WithRawCallbackMethod_CloseSession>;

// A Compute's messages, from its arrival until its answer is serialized.
struct ComputeState {
  v1::ComputeRequest request;
  v1::AttentionResponse response;
  std::shared_ptr<void> answer_bytes;  // inline_output: --max_inflight_bytes, to the reactor
  std::atomic<bool> ran{false};        // AttentionRuntime::Call::ran
};

class StreamService final : public StreamServiceBase {
 public:
  StreamService(AttentionRuntime* runtime, StreamLimits limits)
      : runtime_(runtime),
        table_(limits, runtime->limits(), runtime->backend().staging_pool()),
        reaper_([this] { ReapLoop(); }) {}

  ~StreamService() override {
    {
      std::lock_guard<std::mutex> lock(reaper_mu_);
      stop_ = true;
    }
    reaper_cv_.notify_all();
    reaper_.join();
  }

  using Raw = grpc::ByteBuffer;

  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context, const Raw* request,
                                        Raw* response) override {
    return ServeUnary<v1::AttentionRequest, v1::SessionInfo>(
        context, runtime_->metrics(), grpc_methods::kOpenSession, *request, response,
        [this](const v1::AttentionRequest& header, v1::SessionInfo* info, GrpcCall* call) {
          call->set_request_id(header.request_id());
          // Validated in full (as a native request is) before anything is allocated.
          absl::StatusOr<std::shared_ptr<StreamSession>> session = table_.Open(header);
          if (!session.ok()) return session.status();
          info->set_session_id((*session)->id());
          info->set_idle_timeout_ms(int64_t(table_.limits().idle_timeout.count()));
          return absl::OkStatus();
        });
  }

  grpc::ServerReadReactor<grpc::ByteBuffer>* Upload(grpc::CallbackServerContext* context,
                                                    grpc::ByteBuffer* response) override {
    return NewUploadReactor(context, &table_, response, runtime_->metrics());
  }

  grpc::ServerUnaryReactor* Compute(grpc::CallbackServerContext* context, const Raw* raw_request,
                                    Raw* raw_response) override {
    // A live call until gRPC has written the answer (inline_output carries all of O).
    LiveUnaryReactor* reactor = new LiveUnaryReactor();  // deletes itself (OnDone)
    // Shared with the runtime's done callback, which finishes it.
    auto grpc_call = std::make_shared<GrpcCall>(runtime_->metrics(), grpc_methods::kCompute);
    grpc_call->Start(int64_t(raw_request->Length()));
    auto state = std::make_shared<ComputeState>();
    v1::AttentionResponse* response = &state->response;
    absl::Status parsed = ParseRequest(*raw_request, &state->request);
    if (!parsed.ok()) {
      reactor->Finish(grpc_call->Finish(parsed));
      return reactor;
    }
    const v1::ComputeRequest* request = &state->request;
    grpc_call->set_session_id(request->session_id());
    absl::StatusOr<std::shared_ptr<StreamSession>> found = table_.Find(request->session_id());
    if (!found.ok()) {
      reactor->Finish(grpc_call->Finish(found.status()));
      return reactor;
    }
    std::shared_ptr<StreamSession> session = std::move(*found);
    grpc_call->set_request_id(session->request.request_id());
    if (absl::Status s = session->BeginCompute(); !s.ok()) {
      reactor->Finish(grpc_call->Finish(s));
      return reactor;
    }
    const bool inline_output = request->inline_output();
    AttentionRuntime::Call call;
    call.request = &session->request;
    call.response = inline_output ? response : &session->response;
    // The inputs are where the uploads reassembled them; O and LSE go to the same buffers
    // (unless the runtime has to stage the inputs, then to new ones it puts in the session).
    const IoBuffers& uploaded = *session->io();
    const MemoryKind kind = uploaded.pinned() ? MemoryKind::kPageLocked : MemoryKind::kHeap;
    call.inputs[0] = TensorBytes::Contiguous(kind, uploaded.q(), uploaded.layout().q_bytes);
    call.inputs[1] = TensorBytes::Contiguous(kind, uploaded.k(), uploaded.layout().kv_bytes);
    call.inputs[2] = TensorBytes::Contiguous(kind, uploaded.v(), uploaded.layout().kv_bytes);
    call.io = session->io();
    call.outputs_in_buffers = true;
    call.buffers_out = session->io_for_compute();
    if (inline_output) {  // the answer carries O: counted until sent, within a message's limit
      call.answer_keeps_bytes = &state->answer_bytes;
      call.max_inline_answer_bytes = kMaxInlineAnswerBytes;
    }
    call.received = absl::Now();
    call.deadline = ToAbslTime(context->deadline());
    call.cancelled = [context] { return context->IsCancelled(); };
    call.ran = &state->ran;
    call.done = [this, reactor, context, session, state, response, raw_response, inline_output,
                 grpc_call, uploaded = session->io()](const absl::Status& status) {
      if (!status.ok() && !state->ran.load() && !session->close_requested()) {
        // Never ran (busy, queue full, expired, cancelled): the inputs are as uploaded and the
        // session stays, so that a retry need not upload up to --stream_max_session_bytes again
        // (until session 47 any failure ended it, RESOURCE_EXHAUSTED "retry later" included).
        session->AbortCompute(uploaded);
        FinishUnary(reactor, grpc_call.get(), status, *response, raw_response);
        return;
      }
      if (status.ok() && inline_output) {
        // K = 1: the output goes back in this response (one copy out of the session's buffers).
        const IoBuffers& io = *session->io();
        response->mutable_out()->set_data(io.o(), io.layout().q_bytes);
        if (io.layout().lse_bytes > 0) {
          response->mutable_lse()->set_data(reinterpret_cast<const char*>(io.lse()),
                                            io.layout().lse_bytes);
        }
      }
      if (!status.ok() || inline_output) {
        session->EndCompute(false);
        table_.Erase(session->id());
        reactor->AnswerHandedOver(context, std::move(state->answer_bytes));
        FinishUnary(reactor, grpc_call.get(), status, *response, raw_response);
        return;
      }
      // The output stays in the session for Download; the response says what it is.
      const v1::AttentionResponse& full = session->response;
      response->mutable_out()->set_dtype(full.out().dtype());
      *response->mutable_out()->mutable_shape() = full.out().shape();
      if (full.has_lse()) {
        response->mutable_lse()->set_dtype(full.lse().dtype());
        *response->mutable_lse()->mutable_shape() = full.lse().shape();
      }
      *response->mutable_timing() = full.timing();
      response->set_kernel(full.kernel());
      response->set_request_id(full.request_id());
      session->EndCompute(true);
      if (session->close_requested()) table_.Erase(session->id());  // nobody will download it
      FinishUnary(reactor, grpc_call.get(), absl::OkStatus(), *response, raw_response);
    };
    runtime_->Submit(std::move(call));
    return reactor;
  }

  grpc::ServerWriteReactor<grpc::ByteBuffer>* Download(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override {
    return NewDownloadReactor(context, request, &table_, runtime_->metrics());
  }

  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context, const Raw* request,
                                         Raw* response) override {
    return ServeUnary<v1::CloseSessionRequest, v1::CloseSessionResponse>(
        context, runtime_->metrics(), grpc_methods::kCloseSession, *request, response,
        [this](const v1::CloseSessionRequest& close, v1::CloseSessionResponse*, GrpcCall* call) {
          call->set_session_id(close.session_id());
          absl::StatusOr<std::shared_ptr<StreamSession>> found = table_.Find(close.session_id());
          // Computing: the runtime holds it, and Compute erases it when it answers. Asked first,
          // then the state read: one of the two erases it whichever ends first.
          if (found.ok()) (*found)->RequestClose();
          if (!found.ok() || (*found)->state() != StreamSession::State::kComputing) {
            table_.Erase(close.session_id());
          }
          return absl::OkStatus();
        });
  }

 private:
  void ReapLoop() {
    const auto period = std::clamp<std::chrono::milliseconds>(table_.limits().idle_timeout / 4,
                                                              std::chrono::milliseconds(10),
                                                              std::chrono::milliseconds(1000));
    std::unique_lock<std::mutex> lock(reaper_mu_);
    while (!stop_) {
      reaper_cv_.wait_for(lock, period, [this] { return stop_; });
      if (stop_) break;
      lock.unlock();
      table_.Reap(std::chrono::steady_clock::now());
      lock.lock();
    }
  }

  AttentionRuntime* const runtime_;
  SessionTable table_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool stop_ = false;
  std::thread reaper_;  // last: starts after everything it uses
};

}  // namespace

std::unique_ptr<grpc::Service> CreateStreamService(AttentionRuntime* runtime, StreamLimits limits) {
  return std::make_unique<StreamService>(runtime, limits);
}

}  // namespace flashserve
