// The one middleware every HTTP request passes (common/http_listener.h): header limits, route,
// bearer token, body limit, upload, suspended answer, status conversion, metrics record, log line.
// The libmicrohttpd daemon around it: http_listener_daemon.cc.
#include "common/http_listener.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/client_log.h"
#include "common/http_listener_internal.h"
#include "common/logging.h"
#include "common/utf8.h"
#include "spdlog/spdlog.h"

namespace flashserve {

std::string HttpErrorJson(absl::string_view full) {
  const std::string cut = CutErrorMessage(std::string_view(full.data(), full.size()));
  const std::string_view text = cut;
  const absl::string_view message(cut);
  std::string out = R"({"error":")";
  for (size_t i = 0; i < message.size();) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    if (c >= 0x80) {  // a well-formed character as is (a name the client sent comes back readable),
                      // else U+FFFD
      const size_t n = Utf8MultiByteLength(text, i);
      out += n > 0 ? std::string(message.substr(i, n)) : std::string("\\ufffd");
      i += n > 0 ? n : 1;
      continue;
    }
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(char(c));
    } else if (c < 0x20 || c == 0x7f) {
      out += absl::StrCat("\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(char(c));
    }
    ++i;
  }
  out += R"("})";
  return out;
}

HttpResponse HttpResponse::Json(int status, std::string body) {
  HttpResponse r;
  r.status = status;
  r.body = std::move(body);
  return r;
}

int64_t HttpResponse::size() const {
  int64_t n = int64_t(body.size());
  for (absl::string_view piece : tail) n += int64_t(piece.size());
  return n;
}

HttpRequest::HttpRequest(MHD_Connection* connection, absl::string_view method,
                         absl::string_view path, std::vector<std::string> matches)
    : connection_(connection), method_(method), path_(path), matches_(std::move(matches)) {}

absl::string_view HttpRequest::header(absl::string_view name) const {
  const char* value =
      MHD_lookup_connection_value(connection_, MHD_HEADER_KIND, std::string(name).c_str());
  return value == nullptr ? absl::string_view() : absl::string_view(value);
}

bool HttpRequest::has_header(absl::string_view name) const {
  return MHD_lookup_connection_value(connection_, MHD_HEADER_KIND, std::string(name).c_str()) !=
         nullptr;
}

namespace {

// Every value the connection's request gives header `name` (case-insensitive), in order.
std::vector<std::string> HeaderValues(MHD_Connection* connection, absl::string_view name) {
  struct Wanted {
    absl::string_view name;
    std::vector<std::string> values;
  } wanted{name, {}};
  MHD_get_connection_values(
      connection, MHD_HEADER_KIND,
      [](void* cls, MHD_ValueKind, const char* key, const char* value) -> MHD_Result {
        auto* w = static_cast<Wanted*>(cls);
        if (absl::EqualsIgnoreCase(key, w->name)) w->values.emplace_back(value ? value : "");
        return MHD_YES;
      },
      &wanted);
  return std::move(wanted.values);
}

}  // namespace

std::vector<std::string> HttpRequest::header_values(absl::string_view name) const {
  return HeaderValues(connection_, name);
}

const CompiledRoute* HttpListener::Impl::Find(absl::string_view method, const std::string& path,
                          std::vector<std::string>* matches) const {
  const bool get = method == "GET" || method == "HEAD";
  for (const CompiledRoute& r : routes) {
    if ((r.route.method == "GET") != get || (!get && method != r.route.method)) continue;
    std::smatch m;
    if (std::regex_match(path, m, r.pattern)) {
      for (const auto& group : m) matches->push_back(group.str());
      return &r;
    }
  }
  return nullptr;
}

std::string HttpListener::Impl::AllowedMethods(const std::string& path) const {
  std::vector<std::string> methods;
  for (const CompiledRoute& r : routes) {
    if (!std::regex_match(path, r.pattern)) continue;
    for (const std::string m : r.route.method == "GET" ? std::vector<std::string>{"GET", "HEAD"}
                                                        : std::vector<std::string>{r.route.method}) {
      if (std::find(methods.begin(), methods.end(), m) == methods.end()) methods.push_back(m);
    }
  }
  return absl::StrJoin(methods, ", ");
}

// The header limits libmicrohttpd's memory bound leaves to us: total bytes and field count.
absl::Status HttpListener::Impl::CheckHeaders(MHD_Connection* connection) const {
  struct Count {
    int64_t fields = 0, bytes = 0;
  } count;
  MHD_get_connection_values(
      connection, MHD_HEADER_KIND,
      [](void* cls, MHD_ValueKind, const char* key, const char* value) -> MHD_Result {
        auto* c = static_cast<Count*>(cls);
        ++c->fields;
        c->bytes += int64_t(std::strlen(key)) + (value ? int64_t(std::strlen(value)) : 0) + 4;
        return MHD_YES;
      },
      &count);
  if (count.fields > options.max_headers || count.bytes > options.max_header_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request headers: ", count.fields, " fields, ", count.bytes,
                     " bytes; at most ", options.max_headers, " fields and ",
                     options.max_header_bytes, " bytes are accepted"));
  }
  return absl::OkStatus();
}

absl::Status HttpListener::Impl::CheckFraming(MHD_Connection* connection, bool* has_body) const {
  const std::vector<std::string> lengths = HeaderValues(connection, MHD_HTTP_HEADER_CONTENT_LENGTH);
  const std::vector<std::string> codings =
      HeaderValues(connection, MHD_HTTP_HEADER_TRANSFER_ENCODING);
  const bool transfer_encoded = !codings.empty();
  *has_body = transfer_encoded || (!lengths.empty() && lengths.front() != "0");
  // RFC 9112 6.3: either makes the body's end ambiguous, which a proxy in front may read
  // differently (request smuggling).
  if (std::any_of(lengths.begin(), lengths.end(),
                  [&](const std::string& v) { return v != lengths.front(); })) {
    return absl::InvalidArgumentError("request framing: Content-Length headers that differ");
  }
  if (!lengths.empty() && transfer_encoded) {
    return absl::InvalidArgumentError("request framing: both Transfer-Encoding and Content-Length");
  }
  // RFC 9112 6.3: a request whose last coding is not chunked has no knowable end (answered
  // 400); libmicrohttpd read such a body until the client closed. Only chunked alone is served
  // (no other coding is decoded here), in one field.
  if (transfer_encoded &&
      (codings.size() > 1 ||
       !absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(codings.front()), "chunked"))) {
    return absl::InvalidArgumentError(
        "request framing: Transfer-Encoding must be exactly 'chunked' (no other coding is "
        "accepted)");
  }
  return absl::OkStatus();
}

namespace {

void FreeHeldResponse(void* cls) { delete static_cast<HttpResponse*>(cls); }

MHD_Response* ToMhd(HttpResponse response) {
  MHD_Response* r = nullptr;
  std::vector<std::pair<std::string, std::string>> headers = std::move(response.headers);
  const std::string content_type = response.content_type;
  if (response.tail.empty()) {
    r = MHD_create_response_from_buffer(response.body.size(), response.body.data(),
                                        MHD_RESPMEM_MUST_COPY);
  } else {
    // Header and tensors straight from where they are (sendmsg; GnuTLS copies in blocks).
    auto* held = new HttpResponse(std::move(response));
    std::vector<MHD_IoVec> iov;
    iov.push_back({held->body.data(), held->body.size()});
    for (absl::string_view piece : held->tail) iov.push_back({piece.data(), piece.size()});
    r = MHD_create_response_from_iovec(iov.data(), unsigned(iov.size()), &FreeHeldResponse, held);
    if (r == nullptr) delete held;
  }
  if (r == nullptr) return nullptr;
  if (!content_type.empty()) {
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, content_type.c_str());
  }
  for (const auto& [name, value] : headers) {
    MHD_add_response_header(r, name.c_str(), value.c_str());
  }
  return r;
}

// Whether the peer closed or reset the TCP connection, seen without taking a byte: an error or
// hangup, its FIN (POLLRDHUP: also when bytes are still pending, such as a TLS client's
// close_notify; a client that only stopped sending looks the same, and nginx and Go's net/http
// take it for gone too), or end of input. Pending bytes alone (a pipelined request) are no sign.
bool SocketClosedByPeer(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLHUP | POLLERR | POLLRDHUP)) != 0) return true;
  if ((p.revents & POLLIN) == 0) return false;
  char byte;
  const ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

int ConnectionFd(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
  return info != nullptr ? info->connect_fd : -1;
}

}  // namespace

// The socket is looked at only while the connection is suspended: libmicrohttpd then neither
// reads nor closes it. Once resumed it may close it and the number may name another client's
// connection; `resumed` and `connection` change under `mu`, which is held while looking.
bool http_internal::PendingAnswer::PeerGone() {
  std::lock_guard<std::mutex> lock(mu);
  if (connection == nullptr) return true;  // over: nobody is left to receive an answer
  if (resumed) return false;  // answered (or by the shutdown): the server's doing, not the client's
  return fd >= 0 && SocketClosedByPeer(fd);
}

MHD_Result HttpListener::Impl::Respond(MHD_Connection* connection, RequestState* st,
                                       HttpAnswer answer, absl::string_view metric,
                                       int forced_status) {
  const absl::Status status = answer.status();
  HttpResponse response;
  if (answer.ok()) {
    response = *std::move(answer);
  } else {
    response = HttpResponse::Json(forced_status ? forced_status : HttpStatusFor(status),
                                  HttpErrorJson(status.message()));
    if (response.status == 401) response.headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  const int http_status = response.status;
  const int64_t bytes_out = response.size();
  st->answered = true;
  SetPhase(connection, Phase::kSending);
  MHD_Response* r = ToMhd(std::move(response));
  const MHD_Result queued =
      r == nullptr ? MHD_NO : MHD_queue_response(connection, unsigned(http_status), r);
  if (r != nullptr) MHD_destroy_response(r);
  Report(*st, metric, status, http_status, bytes_out);
  return queued;
}

void HttpListener::Impl::Report(const RequestState& st, absl::string_view metric,
                                const absl::Status& status, int http_status, int64_t bytes_out) {
  if (!metric.empty()) {
    HttpCallRecord record;
    record.metric = std::string(metric);
    record.status = status;
    record.http_status = http_status;
    record.seconds = absl::ToDoubleSeconds(absl::Now() - st.started);
    record.bytes_in = st.bytes_in;
    record.bytes_out = bytes_out;
    if (options.on_finished) options.on_finished(record);
  }
  if (!status.ok() && http_status != 404) {
    const std::string context = st.upload ? st.upload->LogContext() : std::string();
    if (metric.empty() || http_status == 401) {
      spdlog::debug("{} {} failed: {}http={} code={} message=\"{}\"", options.name,
                    metric.empty() ? "request" : std::string(metric), context, http_status,
                    absl::StatusCodeToString(status.code()), LogSafe(status.message()));
    } else {
      WarnFailure(status.code(), "{} {} failed: {}http={} code={} message=\"{}\"", options.name,
                  std::string(metric), context, http_status,
                  absl::StatusCodeToString(status.code()), LogSafe(status.message()));
    }
  }
}

// Answered, then the connection closed: where (or whether) the body ends is not known.
MHD_Result HttpListener::Impl::RefuseAndClose(MHD_Connection* connection, RequestState* st,
                                              absl::string_view why) {
  spdlog::debug("{} request refused: {}", options.name, LogSafe(why));
  HttpResponse refused = HttpResponse::Json(400, HttpErrorJson(why));
  refused.headers.emplace_back(MHD_HTTP_HEADER_CONNECTION, "close");
  return Respond(connection, st, std::move(refused), "");
}

MHD_Result HttpListener::Impl::Begin(MHD_Connection* connection, const char* url,
                                     const char* method, RequestState* st) {
  st->begun = true;
  st->started = absl::Now();
  SetPhase(connection, Phase::kBody);
  if (absl::Status s = CheckHeaders(connection); !s.ok()) {
    return Respond(connection, st, s, "", MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE);
  }
  bool has_body = false;
  if (absl::Status s = CheckFraming(connection, &has_body); !s.ok()) {
    return RefuseAndClose(connection, st, s.message());
  }
  const std::string path(url);
  if (path.size() > kMaxPathBytes) {
    // std::regex matches a frame or more deep per character: a path of ~25,000 bytes overflowed
    // the connection thread's stack (SIGSEGV) before the token was checked.
    return Respond(
        connection, st,
        absl::InvalidArgumentError(absl::StrCat("request path of ", path.size(), " bytes; at most ",
                                                kMaxPathBytes, " are accepted")),
        "", MHD_HTTP_URI_TOO_LONG);
  }
  std::vector<std::string> matches;
  st->route = Find(method, path, &matches);
  // The token before routing (an unauthenticated client learns nothing about the paths) and
  // before any body byte is read.
  if (options.auth != nullptr && (st->route == nullptr || !st->route->route.open)) {
    const char* authorization =
        MHD_lookup_connection_value(connection, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!options.auth->Allows(authorization ? authorization : "")) {
      return Respond(connection, st,
                     absl::UnauthenticatedError("missing or invalid bearer token"), "HTTP");
    }
  }
  if (st->route == nullptr) {
    // RFC 9110 15.5.6: a path served under other methods is 405 naming them, not 404.
    if (const std::string allowed = AllowedMethods(path); !allowed.empty()) {
      HttpResponse refused = HttpResponse::Json(
          405, HttpErrorJson(absl::StrCat("this path is served to ", allowed, " only")));
      refused.headers.emplace_back("Allow", allowed);
      return Respond(connection, st, std::move(refused), "");
    }
    return Respond(connection, st, options.not_found, "");
  }
  const HttpRoute& route = st->route->route;
  if (route.get) {
    // A body for a GET was read and dropped, unbounded, without a token on open routes.
    if (has_body) return RefuseAndClose(connection, st, "a GET request carries no body");
    // Answered on the next call, once libmicrohttpd knows the request has no body (a response
    // queued now would make it close the connection instead of keeping it alive).
    st->get_matches = std::move(matches);
    return MHD_YES;
  }
  HttpRequest request(connection, method, path, std::move(matches));

  int64_t content_length = -1;
  if (const char* length = MHD_lookup_connection_value(connection, MHD_HEADER_KIND,
                                                       MHD_HTTP_HEADER_CONTENT_LENGTH)) {
    if (!absl::SimpleAtoi(length, &content_length)) content_length = -1;
  }
  if (content_length > route.max_body_bytes) {
    return Respond(connection, st,
                   absl::ResourceExhaustedError(absl::StrCat(kBodyOverLimit, route.body_limit_flag,
                                                             "=", route.max_body_bytes)),
                   route.metric);
  }
  absl::StatusOr<std::unique_ptr<HttpUpload>> upload = route.post(request);
  if (!upload.ok()) return Respond(connection, st, upload.status(), route.metric);
  st->upload = *std::move(upload);
  return MHD_YES;
}

// libmicrohttpd takes an answer before the body (first call) or after it, not in the middle: a
// refusal found in the body is answered once the body has ended (the rest is read and dropped),
// and a body that does not end in time is cut off.
MHD_Result HttpListener::Impl::Body(MHD_Connection* connection, RequestState* st,
                                    absl::string_view piece) {
  st->bytes_in += int64_t(piece.size());
  AddBodyBytes(connection, int64_t(piece.size()));
  if (st->upload == nullptr) return MHD_YES;
  const HttpRoute& route = st->route->route;
  const absl::Duration elapsed = absl::Now() - st->started;
  if (elapsed > absl::Seconds(options.body_timeout_s)) {
    st->closed_because = HttpTimeoutError(
        absl::StrCat("the body did not arrive within ", options.body_timeout_s, " s"));
    spdlog::debug("{}: {}; connection closed", options.name,
                  std::string(st->closed_because.message()));
    return MHD_NO;  // closes the connection
  }
  if (options.min_body_bytes_per_s > 0 && elapsed > kMinBodyRateGrace &&
      double(st->bytes_in) <
          absl::ToDoubleSeconds(elapsed) * double(options.min_body_bytes_per_s)) {
    st->closed_because = BodyTooSlowError(elapsed, st->bytes_in);
    spdlog::debug("{}: {}; connection closed", options.name,
                  std::string(st->closed_because.message()));
    return MHD_NO;
  }
  if (!st->failed.ok()) {
    if (st->bytes_in <= route.max_body_bytes + kDrainBytes) return MHD_YES;
    st->closed_because = st->failed;
    return MHD_NO;
  }
  if (st->bytes_in > route.max_body_bytes) {
    st->failed = absl::ResourceExhaustedError(
        absl::StrCat(kBodyOverLimit, route.body_limit_flag, "=", route.max_body_bytes));
    return MHD_YES;
  }
  st->failed = st->upload->OnBody(piece);
  return MHD_YES;
}

MHD_Result HttpListener::Impl::Finish(MHD_Connection* connection, const char* url,
                                      const char* method, RequestState* st) {
  if (st->answered) return MHD_YES;
  const absl::string_view metric =
      st->route ? absl::string_view(st->route->route.metric) : absl::string_view();
  if (!st->failed.ok()) return Respond(connection, st, st->failed, metric);
  if (st->pending != nullptr) {  // resumed: the answer is there
    std::optional<HttpAnswer> answer;
    {
      std::lock_guard<std::mutex> lock(st->pending->mu);
      answer = std::move(st->pending->answer);
      st->pending->answer.reset();
    }
    if (!answer) return MHD_YES;  // not ours to answer yet (cannot happen: resumed with it)
    Unsuspend(st->pending);
    return Respond(connection, st, *std::move(answer), metric);
  }
  if (st->route != nullptr && st->route->route.get) {
    const HttpRoute& route = st->route->route;
    HttpRequest request(connection, method, url, std::move(st->get_matches));
    return Respond(connection, st, route.get(request), route.metric);
  }
  if (st->upload == nullptr) return Respond(connection, st, options.not_found, "");
  // Compute elsewhere; this connection waits suspended and holds no thread.
  SetPhase(connection, Phase::kBusy);
  st->pending = std::make_shared<PendingAnswer>();
  st->pending->connection = connection;
  st->pending->fd = ConnectionFd(connection);
  {
    std::lock_guard<std::mutex> lock(mu);
    suspended.insert(st->pending);
  }
  MHD_suspend_connection(connection);
  // A client that leaves now is seen only through peer_gone: the work stops, and its CANCELLED
  // answer is counted and logged whether it is written to the dead connection (Respond) or the
  // connection is closed first (OnCompleted: ReportUnanswered).
  st->upload->OnComplete(
      [pending = st->pending](HttpAnswer answer) {
        std::lock_guard<std::mutex> lock(pending->mu);
        // The connection is gone, or shutdown answered it already.
        if (pending->connection == nullptr || pending->resumed) return;
        pending->answer = std::move(answer);
        pending->resumed = true;
        MHD_resume_connection(pending->connection);
      },
      [pending = st->pending] { return pending->PeerGone(); });
  return MHD_YES;
}

}  // namespace flashserve
