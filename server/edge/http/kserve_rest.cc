#include "edge/http/kserve_rest.h"

#include <algorithm>
#include <cstring>
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
#include "runtime/shm_requests.h"
#include "spdlog/spdlog.h"

namespace flashserve {

absl::Status ReceiveBudget::Take(int64_t bytes) {
  if (used_.fetch_add(bytes) + bytes > limit_) {
    used_.fetch_sub(bytes);
    return absl::ResourceExhaustedError(absl::StrCat(
        "the HTTP edge holds its most request bytes (--http_max_receive_bytes=", limit_,
        "); retry later"));
  }
  return absl::OkStatus();
}

namespace {

constexpr const char kMethod[] = "KServeInfer";  // the `method` label of REST inferences
constexpr const char kModelPath[] = R"(/v2/models/([^/]+)(?:/versions/([^/]+))?)";

// Budget for a JSON output element while its answer is built and sent: nlohmann's value (16 B)
// and its text (up to 25 B: 17 significant digits of a double, sign, exponent, comma), then
// libmicrohttpd's copy of the text. Measured: 15 B of text per fp16 element.
constexpr int64_t kJsonAnswerBytesPerElement = 48;

// Answers with at least this many output elements in JSON text are built on the answer threads:
// formatting takes ~0.1-0.2 us per element (8M: ~1 s on the 2-core build machine), and on the
// thread that finished the call (the CPU backend's one worker, a CUDA slot's completion thread)
// it held up every other request (test_kserve_rest.py: small ones took 0.63 s of a 1.1 s
// 8M-element answer).
constexpr int64_t kDeferredJsonElements = 64 << 10;
constexpr int kAnswerThreads = 2;
constexpr int kAnswerQueue = 256;  // beyond: built where the call finished, as before

// Elements of O and LSE an answer to `r` holds, JSON and binary (outputs in a client's region:
// none).
struct AnswerElements {
  int64_t json = 0;
  int64_t binary_bytes = 0;
};
AnswerElements AnswerElementsOf(const kserve::RestInferRequest& r) {
  AnswerElements out;
  const auto& shape = r.request.q().shape();
  if (shape.size() != 4) return out;  // refused by validation before this
  const int64_t rows = int64_t(shape[0]) * shape[1] * shape[2];  // batch x seqlen_q x heads_q
  const int64_t elements[2] = {rows * shape[3], rows};           // O, LSE
  const int64_t element_bytes[2] = {
      int64_t(kernels::dtype_size(static_cast<kernels::DType>(r.request.q().dtype()))), 4};
  for (const kserve::OutputSpec& spec : r.outputs) {
    if (spec.shm.set()) continue;
    const int k = spec.kind == kserve::OutputSpec::kOut ? 0 : 1;
    if (spec.binary) {
      out.binary_bytes += elements[k] * element_bytes[k];
    } else {
      out.json += elements[k];
    }
  }
  return out;
}

// The bytes an answer to `r` holds until the client has read it: an unread JSON answer held ~15x
// its binary size outside every budget (15 answers of 30 MiB for 4 MiB requests: +569 MiB RSS).
int64_t AnswerBytesAtMost(const kserve::RestInferRequest& r) {
  const AnswerElements a = AnswerElementsOf(r);
  return a.binary_bytes + a.json * kJsonAnswerBytesPerElement;
}

// Bytes taken from the receive budget, given back when the request is over.
class BudgetHold {
 public:
  explicit BudgetHold(std::shared_ptr<ReceiveBudget> budget) : budget_(std::move(budget)) {}
  ~BudgetHold() {
    if (budget_) budget_->Give(held_);
  }
  BudgetHold(const BudgetHold&) = delete;
  BudgetHold& operator=(const BudgetHold&) = delete;
  absl::Status Take(int64_t bytes) {
    if (!budget_ || bytes <= 0) return absl::OkStatus();
    if (held_ + bytes > budget_->limit()) {
      // This request alone can never fit: too large (413), not busy (503: retry later, forever).
      return absl::ResourceExhaustedError(
          absl::StrCat(kBodyOverLimit, "--http_max_receive_bytes=", budget_->limit(),
                       " (the bytes the HTTP edge holds at once, over all requests)"));
    }
    absl::Status s = budget_->Take(bytes);
    if (s.ok()) held_ += bytes;
    return s;
  }
  int64_t held() const { return held_; }

 private:
  std::shared_ptr<ReceiveBudget> budget_;
  int64_t held_ = 0;
};

// Routes the bytes of one infer body as they arrive: the JSON header into `header_`, then each
// binary input straight into its tensor's data in the AttentionRequest (the only copy of the
// tensor bytes on the way in). Not thread-safe: one per request.
class InferBodyReader {
 public:
  // header_length: Inference-Header-Content-Length (-1: the whole body is JSON);
  // content_length: -1 for a chunked body.
  InferBodyReader(int64_t header_length, int64_t content_length, const KServeRestLimits& limits,
                  const ValidationLimits* validation, BudgetHold* hold)
      : header_length_(header_length),
        content_length_(content_length),
        limits_(limits),
        validation_(validation),
        hold_(hold) {}

  // The JSON header's length is known from the request's headers: refuse before any body byte.
  absl::Status CheckHeaderLength() const {
    const int64_t json_bytes = header_length_ >= 0 ? header_length_ : content_length_;
    if (json_bytes > limits_.max_json_bytes) return JsonTooLarge();
    if (header_length_ >= 0 && content_length_ >= 0 && header_length_ > content_length_) {
      return absl::InvalidArgumentError(
          absl::StrCat("Inference-Header-Content-Length=", header_length_, " exceeds the body's ",
                       content_length_, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status Consume(const char* data, size_t n) {
    received_ += int64_t(n);
    while (n > 0) {
      if (state_ == State::kHeader) {
        size_t take = n;
        if (header_length_ >= 0) take = std::min(n, size_t(header_length_) - header_.size());
        if (int64_t(header_.size() + take) > limits_.max_json_bytes) return JsonTooLarge();
        RETURN_IF_ERROR(hold_->Take(int64_t(take)));
        header_.append(data, take);
        data += take;
        n -= take;
        if (header_length_ >= 0 && int64_t(header_.size()) == header_length_) {
          RETURN_IF_ERROR(ParseHeader());
        }
        continue;
      }
      if (target_ == request_.binary_targets.size()) {
        return absl::InvalidArgumentError(
            "request body: more bytes than the inputs' binary_data_size add up to");
      }
      std::string* target = request_.binary_targets[target_];
      const size_t take = std::min(n, size_t(request_.binary_sizes[target_]) - target->size());
      target->append(data, take);  // into the reserved capacity: pages touched as bytes come
      data += take;
      n -= take;
      SkipFilledTargets();
    }
    return absl::OkStatus();
  }

  // After the body ended: OK when the request is complete.
  absl::Status Finish() {
    if (state_ == State::kHeader) {
      if (header_length_ >= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request body ended after ", received_,
            " bytes, inside its JSON header (Inference-Header-Content-Length=", header_length_,
            ")"));
      }
      RETURN_IF_ERROR(ParseHeader());
    }
    if (target_ < request_.binary_targets.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("request body ended before the binary data of its inputs did (", received_,
                       " bytes received)"));
    }
    return absl::OkStatus();
  }

  kserve::RestInferRequest& request() { return request_; }

 private:
  enum class State {
    kHeader,  // collecting the JSON header
    kBinary,  // filling binary inputs, in input order
  };

  absl::Status JsonTooLarge() const {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request body: JSON header over --http_max_json_bytes=", limits_.max_json_bytes));
  }

  // The answer stays until the client has read it (--answer_timeout_s at most): its bytes count
  // from now, before anything is computed. A request whose body and answer together could never
  // fit the budget is refused as too large (413), not as busy (503: retry later).
  absl::Status TakeAnswerBytes() {
    const int64_t bytes = AnswerBytesAtMost(request_);
    if (limits_.budget != nullptr && hold_->held() + bytes > limits_.budget->limit()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          kBodyOverLimit, "what --http_max_receive_bytes=", limits_.budget->limit(),
          " can hold with its answer: the body holds ", hold_->held(),
          " bytes and the answer would hold ", bytes,
          " until it is read (a JSON output takes up to ", kJsonAnswerBytesPerElement,
          " bytes per element): ask for binary outputs (binary_data_output) or send less"));
    }
    return hold_->Take(bytes);
  }

  absl::Status ParseHeader() {
    const int64_t header_bytes = int64_t(header_.size());
    const int64_t binary_bytes = header_length_ < 0    ? 0
                                 : content_length_ < 0 ? -1
                                                       : content_length_ - header_bytes;
    kserve::RestHeaderChecks checks;
    checks.validation = validation_;
    checks.reserve = [this](int64_t bytes) { return hold_->Take(bytes); };
    checks.capacity_only = true;
    absl::Status s = kserve::ParseRestInferHeader(
        header_, binary_bytes, limits_.max_request_bytes - header_bytes, &request_, checks);
    std::string().swap(header_);
    RETURN_IF_ERROR(s);
    RETURN_IF_ERROR(TakeAnswerBytes());
    state_ = State::kBinary;
    SkipFilledTargets();
    return absl::OkStatus();
  }

  void SkipFilledTargets() {
    while (target_ < request_.binary_targets.size() &&
           int64_t(request_.binary_targets[target_]->size()) == request_.binary_sizes[target_]) {
      ++target_;
    }
  }

  const int64_t header_length_;
  const int64_t content_length_;
  const KServeRestLimits limits_;
  const ValidationLimits* const validation_;
  BudgetHold* const hold_;
  State state_ = State::kHeader;
  std::string header_;
  int64_t received_ = 0;
  kserve::RestInferRequest request_;
  size_t target_ = 0;  // binary input being filled
};

// Per-route state shared by the handlers (read-only after registration).
struct KServeRest {
  AttentionRuntime* runtime;
  kserve::ModelInfo model;
  KServeRestLimits limits;
  // Builds large JSON answers (kDeferredJsonElements). Its tasks hold no KServeRest: one that
  // dropped the last reference would destroy the queue on its own thread.
  std::shared_ptr<WorkQueue> answers;
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

class InferUpload : public HttpUpload {
 public:
  InferUpload(std::shared_ptr<const KServeRest> rest, std::shared_ptr<Exchange> exchange)
      : rest_(std::move(rest)), exchange_(std::move(exchange)) {}

  absl::Status OnBody(absl::string_view piece) override {
    return exchange_->body.Consume(piece.data(), piece.size());
  }

  void OnComplete(HttpReply reply, HttpPeerGone peer_gone) override {
    if (absl::Status s = exchange_->body.Finish(); !s.ok()) {
      reply(s);
      return;
    }
    std::shared_ptr<Exchange> exchange = exchange_;
    std::shared_ptr<const KServeRest> rest = rest_;
    const absl::Time received = exchange->received;
    exchange->infer = std::move(exchange->body.request());
    AttentionRuntime::Call call;
    call.request = &exchange->infer.request;
    call.response = &exchange->response;
    call.received = received;
    if (exchange->infer.timeout_us > 0) {
      call.deadline = received + absl::Microseconds(exchange->infer.timeout_us);
    }
    // A client that closed its connection is a cancel: queued, it is dropped; computing, the CPU
    // backend stops (else a client could leave work of tens of seconds behind, for free).
    call.cancelled = std::move(peer_gone);
    if (absl::Status s = AttachShm(*rest->runtime, ShmReferencesOf(exchange->infer), "", &call,
                                   &exchange->leases);
        !s.ok()) {
      exchange->leases.clear();
      reply(s);
      return;
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

  std::string LogContext() const override {
    // Before OnComplete the request is still the reader's.
    const std::string& id =
        exchange_->infer.has_id ? exchange_->infer.id : exchange_->body.request().id;
    return id.empty() ? std::string() : absl::StrCat("id=\"", LogSafe(id), "\" ");
  }

 private:
  std::shared_ptr<const KServeRest> rest_;
  std::shared_ptr<Exchange> exchange_;
};

absl::StatusOr<std::unique_ptr<HttpUpload>> StartInfer(std::shared_ptr<const KServeRest> rest,
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
  return std::unique_ptr<HttpUpload>(new InferUpload(std::move(rest), std::move(exchange)));
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
  infer.post = [rest](const HttpRequest& req) { return StartInfer(rest, req); };
  routes.push_back(std::move(infer));
  return routes;
}

}  // namespace flashserve
