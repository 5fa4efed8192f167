#include "edge/http/kserve_rest.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/http_status.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/work_queue.h"
#include "edge/http/infer_body.h"
#include "runtime/shm_requests.h"
#include "spdlog/spdlog.h"

namespace flashserve {

namespace {

constexpr const char kMethod[] = "KServeInfer";  // the `method` label of REST inferences
constexpr const char kModelPath[] = R"(/v2/models/([^/]+)(?:/versions/([^/]+))?)";

// Answers with at least this many output elements in JSON text are built on the answer threads:
// formatting takes ~0.1-0.2 us per element (8M: ~1 s on the 2-core build machine), and on the
// thread that finished the call (the CPU backend's one worker, a CUDA slot's completion thread)
// it held up every other request (test_kserve_rest.py: small ones took 0.63 s of a 1.1 s
// 8M-element answer).
constexpr int64_t kDeferredJsonElements = 64 << 10;
constexpr int kAnswerThreads = 2;
constexpr int kAnswerQueue = 256;  // beyond: built where the call finished, as before

// Bodies whose JSON header is kInlineJsonParseBytes or more are parsed on these threads, not on a
// listener thread (infer_body.h). Two: a parse is CPU work, and two threads on a 2-core machine
// leave the listener threads their share. Beyond the queue: 503, retry later.
constexpr int kParseThreads = 2;
constexpr int kParseQueue = 64;

// Per-route state shared by the handlers (read-only after registration).
struct KServeRest {
  AttentionRuntime* runtime;
  kserve::ModelInfo model;
  KServeRestLimits limits;
  // Builds large JSON answers (kDeferredJsonElements). Its tasks hold no KServeRest: one that
  // dropped the last reference would destroy the queue on its own thread.
  std::shared_ptr<WorkQueue> answers;
};

// Parses large JSON headers and starts their calls (kParseThreads), off the listener threads. Not
// in KServeRest: its tasks hold one, and must never hold the queue that runs them (the route and
// the uploads do). Tasks still waiting when it goes (at shutdown, after the listener answered
// every suspended request) run at once with `closing` set: no parse keeps the exit waiting.
class ParseQueue {
 public:
  ParseQueue() : queue_(kParseThreads, kParseQueue) {}
  ~ParseQueue() { closing_->store(true); }  // before queue_'s destructor runs what waits
  ParseQueue(const ParseQueue&) = delete;
  ParseQueue& operator=(const ParseQueue&) = delete;

  bool TrySubmit(std::function<void(bool closing)> task) {
    return queue_.TrySubmit([closing = closing_, task = std::move(task)] { task(closing->load()); });
  }

 private:
  std::shared_ptr<std::atomic<bool>> closing_ = std::make_shared<std::atomic<bool>>(false);
  WorkQueue queue_;
};

// One REST inference from its headers to its answer. Shared by the upload, the runtime's done
// callback and the response (whose binary outputs are sent straight from `response`).
struct Exchange {
  Exchange(const KServeRest& rest, int64_t header_length, int64_t content_length)
      : hold(rest.limits.budget),
        inflight(rest.runtime->metrics()),
        body(header_length, content_length, rest.limits, &rest.runtime->limits(), &hold) {}
  absl::Time received = absl::Now();
  BudgetHold hold;  // declared before what it accounts for: released last
  ServerMetrics::InflightGuard inflight;
  InferBodyReader body;
  kserve::RestInferRequest infer;
  v1::AttentionResponse response;
  kserve::RestInferResponse out;
  ShmLeases leases;  // regions the request names; given back before the answer
};

// The request's shared-memory references (Triton's extension), from its parsed header.
ShmReferences ShmReferencesOf(const kserve::RestInferRequest& infer) {
  ShmReferences refs;
  for (int i = 0; i < 3; ++i) {
    const kserve::ShmParams& p = infer.shm_inputs[i];
    refs.inputs[i] = {p.region, p.offset, p.byte_size};
  }
  for (const kserve::OutputSpec& spec : infer.outputs) {
    refs.outputs[spec.kind] = {spec.shm.region, spec.shm.offset, spec.shm.byte_size};
  }
  return refs;
}

HttpAnswer Answer(const kserve::ModelInfo& model, const std::shared_ptr<Exchange>& exchange) {
  exchange->out = kserve::BuildRestInferResponse(model, exchange->infer, exchange->response);
  kserve::RestInferResponse& out = exchange->out;
  if (spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("{} ok: id=\"{}\" kernel={} total_us={}", kMethod, LogSafe(exchange->infer.id),
                  exchange->response.kernel(), exchange->response.timing().total_us());
  }
  if (!out.has_binary()) return HttpResponse::Json(200, std::move(out.header));
  // Header JSON, then each binary output written straight from the response message.
  HttpResponse res;
  res.content_type = "application/octet-stream";
  res.headers.emplace_back("Inference-Header-Content-Length", std::to_string(out.header.size()));
  res.body = std::move(out.header);
  res.tail = out.binary;
  res.keep = exchange;
  return res;
}

// Starts the call of a body that arrived whole: parses what is left of it, attaches its shared
// memory, queues it. On a listener thread, or on a parse thread for a large JSON header.
void StartCall(const std::shared_ptr<const KServeRest>& rest,
               const std::shared_ptr<Exchange>& exchange, HttpReply reply,
               HttpPeerGone peer_gone) {
  if (peer_gone()) return reply(absl::CancelledError("the client left before its body was parsed"));
  if (absl::Status s = exchange->body.Finish(); !s.ok()) return reply(s);
  exchange->infer = std::move(exchange->body.request());
  AttentionRuntime::Call call;
  call.request = &exchange->infer.request;
  call.response = &exchange->response;
  call.received = exchange->received;
  if (exchange->infer.timeout_us > 0) {
    call.deadline = exchange->received + absl::Microseconds(exchange->infer.timeout_us);
  }
  // A client that closed its connection is a cancel: queued, it is dropped; computing, the CPU
  // backend stops (else a client could leave work of tens of seconds behind, for free).
  call.cancelled = std::move(peer_gone);
  if (absl::Status s = AttachShm(*rest->runtime, ShmReferencesOf(exchange->infer), "", &call,
                                 &exchange->leases);
      !s.ok()) {
    exchange->leases.clear();
    return reply(s);
  }
  call.done = [rest, exchange, reply = std::move(reply)](const absl::Status& done) {
    // The output is in its region: the client may unregister now.
    const absl::Status s = ReleaseShmLeases(done, &exchange->leases);
    if (!s.ok()) return reply(HttpAnswer(s));
    if (AnswerElementsOf(exchange->infer).json >= kDeferredJsonElements &&
        rest->answers->TrySubmit([model = rest->model, exchange, reply] {
          reply(Answer(model, exchange));
        })) {
      return;
    }
    reply(Answer(rest->model, exchange));
  };
  rest->runtime->Submit(std::move(call));
}

class InferUpload : public HttpUpload {
 public:
  InferUpload(std::shared_ptr<const KServeRest> rest, std::shared_ptr<ParseQueue> parses,
              std::shared_ptr<Exchange> exchange)
      : rest_(std::move(rest)), parses_(std::move(parses)), exchange_(std::move(exchange)) {}

  absl::Status OnBody(absl::string_view piece) override {
    return exchange_->body.Consume(piece.data(), piece.size());
  }

  void OnComplete(HttpReply reply, HttpPeerGone peer_gone) override {
    if (!exchange_->body.ParsesLater()) {
      return StartCall(rest_, exchange_, std::move(reply), std::move(peer_gone));
    }
    // The exchange is the task's alone from here: the listener touches it again only once the
    // reply has come (LogContext).
    if (!parses_->TrySubmit([rest = rest_, exchange = exchange_, reply, peer_gone](bool closing) {
          if (closing) return reply(absl::UnavailableError("the server is shutting down"));
          StartCall(rest, exchange, reply, peer_gone);
        })) {
      reply(absl::ResourceExhaustedError(absl::StrCat(
          "the HTTP edge has ", kParseQueue, " large JSON bodies waiting to be parsed; retry later")));
    }
  }

  std::string LogContext() const override {
    // Before the call starts the request is still the reader's.
    const std::string& id =
        exchange_->infer.has_id ? exchange_->infer.id : exchange_->body.request().id;
    return id.empty() ? std::string() : absl::StrCat("id=\"", LogSafe(id), "\" ");
  }

 private:
  std::shared_ptr<const KServeRest> rest_;
  std::shared_ptr<ParseQueue> parses_;
  std::shared_ptr<Exchange> exchange_;
};

absl::StatusOr<std::unique_ptr<HttpUpload>> StartInfer(std::shared_ptr<const KServeRest> rest,
                                                       std::shared_ptr<ParseQueue> parses,
                                                       const HttpRequest& req) {
  RETURN_IF_ERROR(kserve::CheckModel(rest->model, req.match(1), req.match(2)));
  // As for Content-Length (RFC 9112 6.3): two different values split the body at two places, and a
  // proxy in front may take the other one than libmicrohttpd's first.
  const std::vector<std::string> header_lengths =
      req.header_values("Inference-Header-Content-Length");
  for (const std::string& value : header_lengths) {
    if (value != header_lengths.front()) {
      return absl::InvalidArgumentError(
          "Inference-Header-Content-Length: sent more than once with different values");
    }
  }
  int64_t header_length = -1;
  if (req.has_header("Inference-Header-Content-Length") &&
      (!absl::SimpleAtoi(req.header("Inference-Header-Content-Length"), &header_length) ||
       header_length < 0)) {
    return absl::InvalidArgumentError("Inference-Header-Content-Length: must be an integer >= 0");
  }
  int64_t content_length = -1;
  if (req.has_header("Content-Length") &&
      !absl::SimpleAtoi(req.header("Content-Length"), &content_length)) {
    content_length = -1;
  }
  auto exchange = std::make_shared<Exchange>(*rest, header_length, content_length);
  RETURN_IF_ERROR(exchange->body.CheckHeaderLength());
  return std::unique_ptr<HttpUpload>(
      new InferUpload(std::move(rest), std::move(parses), std::move(exchange)));
}

HttpRoute Get(std::string pattern, std::function<HttpAnswer(const HttpRequest&)> handler) {
  HttpRoute route;
  route.method = "GET";
  route.pattern = std::move(pattern);
  route.get = std::move(handler);
  return route;
}

}  // namespace

std::vector<HttpRoute> KServeRestRoutes(AttentionRuntime* runtime,
                                        const kserve::KServeOptions& options,
                                        const KServeRestLimits& limits) {
  auto rest = std::make_shared<KServeRest>();
  rest->runtime = runtime;
  rest->answers = std::make_shared<WorkQueue>(kAnswerThreads, kAnswerQueue);
  rest->model.name = options.model_name;
  rest->model.server_version = options.server_version;
  rest->model.extensions = options.extensions;
  for (kernels::DType dtype : runtime->limits().dtypes) {
    rest->model.dtypes.push_back(static_cast<v1::DType>(dtype));
  }
  rest->limits = limits;
  rest->limits.max_request_bytes = options.max_request_bytes;

  std::vector<HttpRoute> routes;
  routes.push_back(Get("/v2", [rest](const HttpRequest&) -> HttpAnswer {
    return HttpResponse::Json(200, kserve::ServerMetadataJson(rest->model));
  }));
  routes.push_back(Get(kModelPath, [rest](const HttpRequest& req) -> HttpAnswer {
    RETURN_IF_ERROR(kserve::CheckModel(rest->model, req.match(1), req.match(2)));
    return HttpResponse::Json(200, kserve::ModelMetadataJson(rest->model));
  }));
  routes.push_back(
      Get(absl::StrCat(kModelPath, "/ready"), [rest](const HttpRequest& req) -> HttpAnswer {
        RETURN_IF_ERROR(kserve::CheckModel(rest->model, req.match(1), req.match(2)));
        const bool ready = rest->runtime->ready();
        return HttpResponse::Json(ready ? 200 : 503, kserve::ModelReadyJson(rest->model, ready));
      }));
  HttpRoute infer;
  infer.method = "POST";
  infer.pattern = absl::StrCat(kModelPath, "/infer");
  infer.metric = kMethod;
  infer.max_body_bytes = rest->limits.max_request_bytes;
  infer.post = [rest, parses = std::make_shared<ParseQueue>()](const HttpRequest& req) {
    return StartInfer(rest, parses, req);
  };
  routes.push_back(std::move(infer));
  return routes;
}

}  // namespace flashserve
