#include "edge/http/kserve_rest.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "httplib.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

using kserve::ErrorJson;
using kserve::HttpStatusFor;

constexpr const char kMethod[] = "KServeInfer";  // the `method` label of REST inferences
constexpr const char kModelPath[] = R"(/v2/models/([^/]+)(?:/versions/([^/]+))?)";

// Routes the bytes of one infer body as they arrive: the JSON header into `header_`, then each
// binary input straight into its tensor's data in the AttentionRequest (the only copy of the
// tensor bytes on the way in). Not thread-safe: one per request.
class InferBodyReader {
 public:
  // header_length: Inference-Header-Content-Length (-1: the whole body is JSON);
  // content_length: -1 for a chunked body.
  InferBodyReader(int64_t header_length, int64_t content_length, int64_t max_bytes)
      : header_length_(header_length), content_length_(content_length), max_bytes_(max_bytes) {
    if (header_length_ >= 0 && content_length_ >= 0 && header_length_ > content_length_) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("Inference-Header-Content-Length=", header_length_, " exceeds the body's ",
                       content_length_, " bytes")));
    } else if (header_length_ > 0) {
      header_.reserve(size_t(header_length_));
    }
  }

  // The content receiver: false stops reading (only for a chunked body over the limit).
  bool Consume(const char* data, size_t n) {
    received_ += int64_t(n);
    if (received_ > max_bytes_) {
      Fail(absl::ResourceExhaustedError(
          absl::StrCat("request body exceeds --max_request_bytes=", max_bytes_)));
      return false;
    }
    while (n > 0) {
      switch (state_) {
        case State::kHeader: {
          size_t take = n;
          if (header_length_ >= 0) {
            take = std::min(n, size_t(header_length_) - header_.size());
          }
          header_.append(data, take);
          data += take;
          n -= take;
          if (header_length_ >= 0 && int64_t(header_.size()) == header_length_) ParseHeader();
          break;
        }
        case State::kBinary: {
          if (target_ == request_.binary_targets.size()) {
            Fail(absl::InvalidArgumentError(
                "request body: more bytes than the inputs' binary_data_size add up to"));
            break;
          }
          std::string* target = request_.binary_targets[target_];
          const size_t take = std::min(n, target->size() - filled_);
          std::memcpy(target->data() + filled_, data, take);
          filled_ += take;
          data += take;
          n -= take;
          SkipFilledTargets();
          break;
        }
        case State::kDrain:  // an error is known; read the rest so the connection stays usable
          n = 0;
          break;
      }
    }
    return true;
  }

  // After the body ended: the request, or what was wrong with it.
  absl::Status Finish() {
    if (state_ == State::kHeader) {
      if (header_length_ < 0) {
        ParseHeader();
      } else {
        Fail(absl::InvalidArgumentError(absl::StrCat(
            "request body ended after ", received_,
            " bytes, inside its JSON header (Inference-Header-Content-Length=", header_length_,
            ")")));
      }
    }
    if (state_ == State::kBinary && target_ < request_.binary_targets.size()) {
      Fail(absl::InvalidArgumentError(
          absl::StrCat("request body ended before the binary data of its inputs did (", received_,
                       " bytes received)")));
    }
    return status_;
  }

  void Fail(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
    state_ = State::kDrain;
  }

  int64_t received() const { return received_; }
  kserve::RestInferRequest& request() { return request_; }

 private:
  enum class State {
    kHeader,  // collecting the JSON header
    kBinary,  // filling binary inputs, in input order
    kDrain,   // failed: discarding the rest of the body
  };

  void ParseHeader() {
    const int64_t header_bytes = int64_t(header_.size());
    const int64_t binary_bytes = header_length_ < 0    ? 0
                                 : content_length_ < 0 ? -1
                                                       : content_length_ - header_bytes;
    absl::Status s =
        kserve::ParseRestInferHeader(header_, binary_bytes, max_bytes_ - header_bytes, &request_);
    std::string().swap(header_);
    if (!s.ok()) {
      Fail(std::move(s));
      return;
    }
    state_ = State::kBinary;
    SkipFilledTargets();
  }

  void SkipFilledTargets() {
    while (target_ < request_.binary_targets.size() &&
           filled_ == request_.binary_targets[target_]->size()) {
      ++target_;
      filled_ = 0;
    }
  }

  const int64_t header_length_;
  const int64_t content_length_;
  const int64_t max_bytes_;
  State state_ = State::kHeader;
  absl::Status status_;
  std::string header_;
  int64_t received_ = 0;
  kserve::RestInferRequest request_;
  size_t target_ = 0;  // binary input being filled
  size_t filled_ = 0;  // bytes of it filled so far
};

// Per-route state shared by the handlers (read-only after registration).
struct KServeRest {
  AttentionRuntime* runtime;
  kserve::ModelInfo model;
  int64_t max_request_bytes;
};

void SetJson(httplib::Response& res, int status, std::string body) {
  res.status = status;
  res.body = std::move(body);
  res.set_header("Content-Type", "application/json");
}

void SetError(httplib::Response& res, const absl::Status& status) {
  SetJson(res, HttpStatusFor(status), ErrorJson(status.message()));
}

std::string Match(const httplib::Request& req, size_t i) {
  return i < req.matches.size() ? std::string(req.matches[i]) : std::string();
}

// One REST inference, from the body's first byte to the response (set on `res`).
void Infer(const KServeRest& rest, const httplib::Request& req, httplib::Response& res,
           const httplib::ContentReader& reader) {
  const absl::Time received = absl::Now();
  ServerMetrics* metrics = rest.runtime->metrics();
  ServerMetrics::InflightGuard inflight(metrics);

  int64_t header_length = -1;
  absl::Status early = kserve::CheckModel(rest.model, Match(req, 1), Match(req, 2));
  if (req.has_header("Inference-Header-Content-Length")) {
    if (!absl::SimpleAtoi(req.get_header_value("Inference-Header-Content-Length"),
                          &header_length) ||
        header_length < 0) {
      early.Update(
          absl::InvalidArgumentError("Inference-Header-Content-Length: must be an integer >= 0"));
      header_length = -1;
    }
  }
  int64_t content_length = -1;
  if (req.has_header("Content-Length") &&
      !absl::SimpleAtoi(req.get_header_value("Content-Length"), &content_length)) {
    content_length = -1;
  }
  InferBodyReader body(header_length, content_length, rest.max_request_bytes);
  if (!early.ok()) body.Fail(early);
  const bool read = reader([&body](const char* data, size_t n) { return body.Consume(data, n); });
  absl::Status status;
  if (read) {
    status = body.Finish();
  } else if (res.status == 413 || body.received() > rest.max_request_bytes) {
    // Over --max_request_bytes: by its Content-Length (httplib skipped it) or as it came.
    status = absl::ResourceExhaustedError(
        absl::StrCat("request body exceeds --max_request_bytes=", rest.max_request_bytes));
  } else {
    status = absl::InvalidArgumentError("request body: could not be read");
  }

  // The exchange outlives this handler when the response streams from it (binary outputs).
  struct Exchange {
    kserve::RestInferRequest infer;
    v1::AttentionResponse response;
    kserve::RestInferResponse out;
  };
  auto exchange = std::make_shared<Exchange>();
  if (status.ok()) {
    exchange->infer = std::move(body.request());
    AttentionRuntime::Call call;
    call.request = &exchange->infer.request;
    call.response = &exchange->response;
    call.received = received;
    if (exchange->infer.timeout_us > 0) {
      call.deadline = received + absl::Microseconds(exchange->infer.timeout_us);
    }
    absl::Notification finished;
    call.done = [&status, &finished](const absl::Status& s) {
      status = s;
      finished.Notify();
    };
    rest.runtime->Submit(std::move(call));
    finished.WaitForNotification();
  }

  int64_t bytes_out = 0;
  if (!status.ok()) {
    SetError(res, status);
    bytes_out = int64_t(res.body.size());
    spdlog::warn("{} failed: id=\"{}\" http={} code={} message=\"{}\"", kMethod,
                 LogSafe(exchange->infer.id), res.status, absl::StatusCodeToString(status.code()),
                 std::string(status.message()));
  } else {
    exchange->out = kserve::BuildRestInferResponse(rest.model, exchange->infer, exchange->response);
    kserve::RestInferResponse& out = exchange->out;
    if (!out.has_binary()) {
      SetJson(res, 200, std::move(out.header));
      bytes_out = int64_t(res.body.size());
    } else {
      // Header JSON, then each binary output written straight from the response message.
      const size_t header_size = out.header.size();
      const size_t total = header_size + size_t(out.binary_bytes());
      bytes_out = int64_t(total);
      res.status = 200;
      res.set_header("Inference-Header-Content-Length", std::to_string(header_size));
      res.set_content_provider(total, "application/octet-stream",
                               [exchange](size_t offset, size_t length, httplib::DataSink& sink) {
                                 const kserve::RestInferResponse& o = exchange->out;
                                 size_t begin = 0;
                                 auto write_from = [&](absl::string_view part) {
                                   const size_t end = begin + part.size();
                                   if (offset < end && length > 0) {
                                     const size_t skip = offset - begin;
                                     const size_t n = std::min(part.size() - skip, length);
                                     if (!sink.write(part.data() + skip, n)) return false;
                                     offset += n;
                                     length -= n;
                                   }
                                   begin = end;
                                   return true;
                                 };
                                 if (!write_from(o.header)) return false;
                                 for (absl::string_view part : o.binary) {
                                   if (!write_from(part)) return false;
                                 }
                                 return true;
                               });
    }
    if (spdlog::should_log(spdlog::level::debug)) {
      spdlog::debug("{} ok: id=\"{}\" kernel={} total_us={}", kMethod, LogSafe(exchange->infer.id),
                    exchange->response.kernel(), exchange->response.timing().total_us());
    }
  }
  if (metrics != nullptr) {
    metrics->RecordRequest(kMethod, static_cast<int>(status.code()),
                           absl::ToDoubleSeconds(absl::Now() - received), body.received(),
                           bytes_out);
  }
}

}  // namespace

void RegisterKServeRoutes(httplib::Server& server, AttentionRuntime* runtime,
                          const kserve::KServeOptions& options) {
  auto rest = std::make_shared<KServeRest>();
  rest->runtime = runtime;
  rest->model.name = options.model_name;
  rest->model.server_version = options.server_version;
  for (kernels::DType dtype : runtime->limits().dtypes) {
    rest->model.dtypes.push_back(static_cast<v1::DType>(dtype));
  }
  rest->max_request_bytes = options.max_request_bytes;

  server.Get("/v2", [rest](const httplib::Request&, httplib::Response& res) {
    SetJson(res, 200, kserve::ServerMetadataJson(rest->model));
  });
  server.Get(kModelPath, [rest](const httplib::Request& req, httplib::Response& res) {
    if (absl::Status s = kserve::CheckModel(rest->model, Match(req, 1), Match(req, 2)); !s.ok()) {
      SetError(res, s);
      return;
    }
    SetJson(res, 200, kserve::ModelMetadataJson(rest->model));
  });
  server.Get(absl::StrCat(kModelPath, "/ready"), [rest](const httplib::Request& req,
                                                        httplib::Response& res) {
    if (absl::Status s = kserve::CheckModel(rest->model, Match(req, 1), Match(req, 2)); !s.ok()) {
      SetError(res, s);
      return;
    }
    const bool ready = rest->runtime->ready();
    SetJson(res, ready ? 200 : 503, kserve::ModelReadyJson(rest->model, ready));
  });
  server.Post(absl::StrCat(kModelPath, "/infer"),
              [rest](const httplib::Request& req, httplib::Response& res,
                     const httplib::ContentReader& reader) { Infer(*rest, req, res, reader); });
}

}  // namespace flashserve
