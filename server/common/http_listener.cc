// GNU libmicrohttpd under the HttpListener interface, and the one middleware every request passes.
//
// Why libmicrohttpd (GNU, Debian package libmicrohttpd-dev, >= 0.9.75): its epoll threads serve
// any number of connections (a slow client costs a socket and a bounded buffer, never a thread);
// the daemon itself enforces the connection cap, the per-address cap, the idle timeout and the
// per-connection memory limit that bounds the request line and headers (431/414 beyond); bodies
// come to us piece by piece as they arrive; suspend/resume lets a request wait for its compute
// without a thread; TLS is GnuTLS. With libevent's evhttp or Boost.Beast more of that bookkeeping
// would be ours to write. See server/edge/http/README.md.
#include "common/http_listener.h"

#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace flashserve {

std::string HttpErrorJson(absl::string_view message) {
  std::string out = R"({"error":")";
  for (unsigned char c : message) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(char(c));
    } else if (c < 0x20 || c >= 0x7f) {  // control bytes escaped; non-ASCII may be invalid UTF-8
      out += absl::StrCat("\\u00", absl::Hex(c, absl::kZeroPad2));
    } else {
      out.push_back(char(c));
    }
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

// Body bytes read and dropped past the size limit before a refused upload is cut off.
constexpr int64_t kDrainBytes = int64_t{16} << 20;

// Where a connection is, for the timeout sweeper.
enum class Phase { kAwaiting, kHeaders, kBody, kBusy };

struct ConnectionState {
  int fd = -1;
  Phase phase = Phase::kAwaiting;
  absl::Time since = absl::Now();
};

// A suspended request's answer, handed over from whichever thread computes it.
struct PendingAnswer {
  std::mutex mu;
  MHD_Connection* connection = nullptr;  // null once the request is over (closed, shut down)
  std::optional<HttpAnswer> answer;
};

struct CompiledRoute {
  HttpRoute route;
  std::regex pattern;
};

struct RequestState {
  bool begun = false;  // headers in, the middleware ran
  bool answered = false;
  const CompiledRoute* route = nullptr;
  absl::Time started;  // end of the headers
  int64_t bytes_in = 0;
  std::unique_ptr<HttpUpload> upload;
  absl::Status failed;  // the upload was refused: the rest of the body is dropped
  absl::Status closed_because;  // why the connection was cut off without an answer
  std::shared_ptr<PendingAnswer> pending;  // set once OnComplete ran
  std::vector<std::string> get_matches;    // a GET route's groups, until it is answered
};

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::stringstream text;
  text << in.rdbuf();
  *out = text.str();
  return true;
}

// Each connection is one file descriptor: make room for `connections` more under the hard limit.
void RaiseOpenFileLimit(const std::string& name, int connections) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t want = limit.rlim_cur + rlim_t(connections);
  if (limit.rlim_cur >= rlim_t(connections) * 2 + 256) return;
  rlimit raised = limit;
  raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? want : std::min(want, limit.rlim_max);
  if (raised.rlim_cur > limit.rlim_cur) setrlimit(RLIMIT_NOFILE, &raised);
  if (raised.rlim_cur < want) {
    spdlog::warn("{}: open-file limit {} (hard {}) is below what {} connections need; raise "
                 "ulimit -n or lower --http_max_connections",
                 name, raised.rlim_cur, limit.rlim_max, connections);
  }
}

}  // namespace

struct HttpListener::Impl {
  HttpListenerOptions options;
  std::vector<CompiledRoute> routes;
  MHD_Daemon* daemon = nullptr;
  std::string tls_cert, tls_key;  // must outlive the daemon

  std::mutex mu;  // guards connections and stop
  std::set<ConnectionState*> connections;
  bool stop = false;
  std::condition_variable stop_cv;
  std::thread sweeper;

  void SetPhase(MHD_Connection* connection, Phase phase) {
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (info == nullptr || info->socket_context == nullptr) return;
    auto* state = static_cast<ConnectionState*>(info->socket_context);
    std::lock_guard<std::mutex> lock(mu);
    state->phase = phase;
    state->since = absl::Now();
  }

  // Closes connections stuck in the request line or headers (a slowloris trickles them). The
  // socket is shut down, not closed, under `mu`: libmicrohttpd sees end of input and closes it
  // itself, and it cannot have closed the descriptor yet (its close notification takes `mu`).
  void Sweep() {
    const absl::Duration idle = absl::Seconds(options.idle_timeout_s);
    const absl::Duration header = absl::Seconds(options.header_timeout_s);
    const absl::Duration body = absl::Seconds(options.body_timeout_s);
    std::unique_lock<std::mutex> lock(mu);
    while (!stop) {
      stop_cv.wait_for(lock, std::chrono::milliseconds(250));
      const absl::Time now = absl::Now();
      for (ConnectionState* c : connections) {
        absl::Duration limit = absl::InfiniteDuration();
        if (c->phase == Phase::kAwaiting) limit = idle + header;  // silent ones: idle timeout
        if (c->phase == Phase::kHeaders) limit = header;
        if (c->phase == Phase::kBody) limit = body + idle;  // trickles get 408 in Body()
        if (now - c->since > limit && c->fd >= 0) {
          shutdown(c->fd, SHUT_RDWR);
          c->fd = -1;
        }
      }
    }
  }

  const CompiledRoute* Find(absl::string_view method, const std::string& path,
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

  // The header limits libmicrohttpd's memory bound leaves to us: total bytes and field count.
  absl::Status CheckHeaders(MHD_Connection* connection) const {
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

  MHD_Result Respond(MHD_Connection* connection, RequestState* st, HttpAnswer answer,
                     absl::string_view metric, int forced_status = 0);
  MHD_Result Begin(MHD_Connection* connection, const char* url, const char* method,
                   RequestState* st);
  MHD_Result Body(MHD_Connection* connection, RequestState* st, absl::string_view piece);
  MHD_Result Finish(MHD_Connection* connection, const char* url, const char* method,
                    RequestState* st);
};

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

}  // namespace

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
  SetPhase(connection, Phase::kBusy);
  MHD_Response* r = ToMhd(std::move(response));
  const MHD_Result queued =
      r == nullptr ? MHD_NO : MHD_queue_response(connection, unsigned(http_status), r);
  if (r != nullptr) MHD_destroy_response(r);

  if (!metric.empty()) {
    HttpCallRecord record;
    record.metric = std::string(metric);
    record.status = status;
    record.http_status = http_status;
    record.seconds = absl::ToDoubleSeconds(absl::Now() - st->started);
    record.bytes_in = st->bytes_in;
    record.bytes_out = bytes_out;
    if (options.on_finished) options.on_finished(record);
  }
  if (!status.ok() && http_status != 404) {
    const std::string context = st->upload ? st->upload->LogContext() : std::string();
    const auto level = metric.empty() || http_status == 401 ? spdlog::level::debug
                                                            : spdlog::level::warn;
    spdlog::log(level, "{} {} failed: {}http={} code={} message=\"{}\"", options.name,
                metric.empty() ? "request" : std::string(metric), context, http_status,
                absl::StatusCodeToString(status.code()), LogSafe(status.message()));
  }
  return queued;
}

MHD_Result HttpListener::Impl::Begin(MHD_Connection* connection, const char* url,
                                     const char* method, RequestState* st) {
  st->begun = true;
  st->started = absl::Now();
  SetPhase(connection, Phase::kBody);
  if (absl::Status s = CheckHeaders(connection); !s.ok()) {
    return Respond(connection, st, s, "", MHD_HTTP_REQUEST_HEADER_FIELDS_TOO_LARGE);
  }
  const std::string path(url);
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
  if (st->route == nullptr) return Respond(connection, st, options.not_found, "");
  const HttpRoute& route = st->route->route;
  if (route.get) {
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
                   absl::ResourceExhaustedError(absl::StrCat("request body exceeds ",
                                                             route.body_limit_flag, "=",
                                                             route.max_body_bytes)),
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
  if (st->upload == nullptr) return MHD_YES;
  const HttpRoute& route = st->route->route;
  if (absl::Now() - st->started > absl::Seconds(options.body_timeout_s)) {
    st->closed_because = HttpTimeoutError(
        absl::StrCat("the body did not arrive within ", options.body_timeout_s, " s"));
    spdlog::debug("{}: {}; connection closed", options.name,
                  std::string(st->closed_because.message()));
    return MHD_NO;  // closes the connection
  }
  if (!st->failed.ok()) {
    if (st->bytes_in <= route.max_body_bytes + kDrainBytes) return MHD_YES;
    st->closed_because = st->failed;
    return MHD_NO;
  }
  if (st->bytes_in > route.max_body_bytes) {
    st->failed = absl::ResourceExhaustedError(
        absl::StrCat("request body exceeds ", route.body_limit_flag, "=", route.max_body_bytes));
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
    }
    if (!answer) return MHD_YES;  // not ours to answer yet (cannot happen: resumed with it)
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
  MHD_suspend_connection(connection);
  st->upload->OnComplete([pending = st->pending](HttpAnswer answer) {
    std::lock_guard<std::mutex> lock(pending->mu);
    if (pending->connection == nullptr) return;  // the connection is gone
    pending->answer = std::move(answer);
    MHD_resume_connection(pending->connection);
  });
  return MHD_YES;
}

namespace {

MHD_Result OnAccess(void* cls, MHD_Connection* connection, const char* url, const char* method,
                    const char* /*version*/, const char* upload_data, size_t* upload_data_size,
                    void** request_context) {
  auto* impl = static_cast<HttpListener::Impl*>(cls);
  auto* st = static_cast<RequestState*>(*request_context);
  if (st == nullptr) {
    st = new RequestState();
    *request_context = st;
  }
  if (!st->begun) return impl->Begin(connection, url, method, st);
  if (*upload_data_size > 0) {
    const absl::string_view piece(upload_data, *upload_data_size);
    *upload_data_size = 0;
    if (st->answered) return MHD_YES;
    return impl->Body(connection, st, piece);
  }
  return impl->Finish(connection, url, method, st);
}

void OnCompleted(void* cls, MHD_Connection* connection, void** request_context,
                 MHD_RequestTerminationCode code) {
  auto* impl = static_cast<HttpListener::Impl*>(cls);
  auto* st = static_cast<RequestState*>(*request_context);
  *request_context = nullptr;
  if (st != nullptr) {
    if (st->pending != nullptr) {
      std::lock_guard<std::mutex> lock(st->pending->mu);
      st->pending->connection = nullptr;
    }
    if (st->begun && !st->answered && st->route != nullptr && !st->route->route.metric.empty() &&
        impl->options.on_finished) {
      HttpCallRecord record;
      record.metric = st->route->route.metric;
      record.status = !st->closed_because.ok() ? st->closed_because
                      : code == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED
                          ? HttpTimeoutError("idle")
                          : absl::CancelledError("connection closed");
      record.http_status = 0;
      record.seconds = absl::ToDoubleSeconds(absl::Now() - st->started);
      record.bytes_in = st->bytes_in;
      impl->options.on_finished(record);
    }
    delete st;
  }
  impl->SetPhase(connection, Phase::kAwaiting);
}

void* OnRequestLine(void* cls, const char* /*uri*/, MHD_Connection* connection) {
  static_cast<HttpListener::Impl*>(cls)->SetPhase(connection, Phase::kHeaders);
  return new RequestState();
}

void OnConnection(void* cls, MHD_Connection* connection, void** socket_context,
                  MHD_ConnectionNotificationCode code) {
  auto* impl = static_cast<HttpListener::Impl*>(cls);
  if (code == MHD_CONNECTION_NOTIFY_STARTED) {
    auto* state = new ConnectionState();
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info != nullptr) state->fd = info->connect_fd;
    *socket_context = state;
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->connections.insert(state);
  } else if (*socket_context != nullptr) {  // closed: before the descriptor is
    auto* state = static_cast<ConnectionState*>(*socket_context);
    // A close with unread input makes the kernel send a reset, which can destroy an answer the
    // client has not read yet (a refused upload it is still sending): drop what is queued.
    const MHD_ConnectionInfo* info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (info != nullptr) {
      char sink[16384];
      for (int i = 0; i < 256 && recv(info->connect_fd, sink, sizeof(sink), MSG_DONTWAIT) > 0;) {
        ++i;
      }
    }
    {
      std::lock_guard<std::mutex> lock(impl->mu);
      impl->connections.erase(state);
    }
    delete state;
    *socket_context = nullptr;
  }
}

void LogFromMhd(void* cls, const char* format, va_list args) {
  char line[512];
  vsnprintf(line, sizeof(line), format, args);
  std::string text = absl::StripTrailingAsciiWhitespace(line).data();
  spdlog::debug("{}: libmicrohttpd: {}", static_cast<HttpListener::Impl*>(cls)->options.name,
                LogSafe(text));
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpListener>> HttpListener::Start(
    const HttpListenerOptions& options, std::vector<HttpRoute> routes) {
  if (options.max_connections < 1 || options.max_connections_per_ip < 0 ||
      options.max_header_bytes < 1024 || options.max_headers < 1 || options.idle_timeout_s < 1 ||
      options.header_timeout_s < 1 || options.body_timeout_s < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        options.name, ": --http_max_connections must be >= 1, --http_max_connections_per_ip >= 0, "
                      "--http_max_header_bytes >= 1024 and the --http_*_timeout_s >= 1"));
  }
  auto listener = std::unique_ptr<HttpListener>(new HttpListener());
  listener->impl_ = std::make_unique<Impl>();
  Impl& impl = *listener->impl_;
  impl.options = options;
  for (HttpRoute& route : routes) {
    std::regex pattern(route.pattern);
    impl.routes.push_back({std::move(route), std::move(pattern)});
  }
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                   MHD_USE_ERROR_LOG;
  const bool tls = !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (tls) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
    }
    if (!ReadFile(options.tls_cert_file, &impl.tls_cert) ||
        !ReadFile(options.tls_key_file, &impl.tls_key)) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.name, ": cannot read the TLS certificate ", options.tls_cert_file,
                       " / key ", options.tls_key_file));
    }
    flags |= MHD_USE_TLS;
  }
  // The address: numeric or a name, IPv4 or IPv6.
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* resolved = nullptr;
  if (getaddrinfo(options.host.c_str(), std::to_string(options.port).c_str(), &hints, &resolved) !=
          0 ||
      resolved == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(options.name, ": cannot resolve the address ", options.host));
  }
  sockaddr_storage address{};
  std::memcpy(&address, resolved->ai_addr, resolved->ai_addrlen);
  if (resolved->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
  freeaddrinfo(resolved);

  RaiseOpenFileLimit(options.name, options.max_connections);
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_EXTERNAL_LOGGER, intptr_t(&LogFromMhd), &impl},  // first: it logs the others
      {MHD_OPTION_SOCK_ADDR, 0, &address},
      {MHD_OPTION_CONNECTION_LIMIT, options.max_connections, nullptr},
      {MHD_OPTION_PER_IP_CONNECTION_LIMIT, options.max_connections_per_ip, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, options.idle_timeout_s, nullptr},
      // Request line and headers live in this pool (431/414 beyond); the rest buffers the body.
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, options.max_header_bytes + (16 << 10), nullptr},
      {MHD_OPTION_LISTEN_BACKLOG_SIZE, 4096, nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, intptr_t(&OnCompleted), &impl},
      {MHD_OPTION_NOTIFY_CONNECTION, intptr_t(&OnConnection), &impl},
      {MHD_OPTION_URI_LOG_CALLBACK, intptr_t(&OnRequestLine), &impl},
  };
  if (options.threads > 1) items.push_back({MHD_OPTION_THREAD_POOL_SIZE, options.threads, nullptr});
  if (tls) {
    items.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0, impl.tls_cert.data()});
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, impl.tls_key.data()});
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  impl.daemon = MHD_start_daemon(flags, 0, nullptr, nullptr, &OnAccess, &impl,
                                 MHD_OPTION_ARRAY, items.data(), MHD_OPTION_END);
  if (impl.daemon == nullptr) {
    if (tls) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.name, ": cannot listen on ", options.host, ":", options.port,
                       " with the TLS certificate ", options.tls_cert_file, " / key ",
                       options.tls_key_file, " (address taken, or not a PEM certificate and key)"));
    }
    return absl::UnavailableError(
        absl::StrCat(options.name, ": cannot listen on ", options.host, ":", options.port));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(impl.daemon, MHD_DAEMON_INFO_BIND_PORT);
  listener->port_ = info != nullptr ? info->port : options.port;
  impl.sweeper = std::thread([&impl] { impl.Sweep(); });
  return listener;
}

HttpListener::~HttpListener() { Stop(); }

void HttpListener::Stop(absl::Duration finish_answers) {
  if (impl_ == nullptr) return;
  if (impl_->daemon != nullptr) {
    // No new connections; answers being written (a large one to a slow reader) may finish.
    const MHD_socket listen = MHD_quiesce_daemon(impl_->daemon);
    if (listen != MHD_INVALID_SOCKET) close(listen);
    const absl::Time deadline = absl::Now() + finish_answers;
    while (absl::Now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        bool busy = false;
        for (const ConnectionState* c : impl_->connections) busy |= c->phase == Phase::kBusy;
        if (!busy) break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->stop_cv.notify_all();
  if (impl_->sweeper.joinable()) impl_->sweeper.join();
  if (impl_->daemon != nullptr) {
    MHD_stop_daemon(impl_->daemon);
    impl_->daemon = nullptr;
  }
}

}  // namespace flashserve
