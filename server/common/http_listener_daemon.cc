// The libmicrohttpd daemon under HttpListener: options, start and stop, its callbacks (which
// hand each request to the middleware in http_listener.cc) and the timeout sweeper.
//
// Why libmicrohttpd (GNU, Debian package libmicrohttpd-dev, >= 0.9.75): its epoll threads serve
// any number of connections (a slow client costs a socket and a bounded buffer, never a thread);
// the daemon itself enforces the connection cap, the per-address cap, the idle timeout and the
// per-connection memory limit that bounds the request line and headers (431/414 beyond); bodies
// come to us piece by piece as they arrive; suspend/resume lets a request wait for its compute
// without a thread; TLS is GnuTLS. With libevent's evhttp or Boost.Beast more of that bookkeeping
// would be ours to write. See server/edge/http/README.md.
#include <microhttpd.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/flag_file.h"
#include "common/http_listener.h"
#include "common/http_listener_internal.h"
#include "common/logging.h"
#include "spdlog/spdlog.h"

namespace flashserve {
namespace {

bool ReadFile(const std::string& path, std::string* out) {
  absl::StatusOr<std::string> text = ReadFlagFile(path, "--tls_cert / --tls_key", kMaxPemFileBytes);
  if (!text.ok()) return false;
  *out = *std::move(text);
  return true;
}

// Each connection is one file descriptor: raises the soft open-file limit toward the hard one to
// fit `connections` on this port, as many on the other and room for gRPC. When the hard limit is
// too low, returns a smaller cap (a third of what is left above 256 descriptors), with a warning,
// rather than let accept() fail for every port once the descriptors run out.
int FitConnections(const std::string& name, int connections) {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return connections;
  const rlim_t want = rlim_t(connections) * 3 + 256;
  if (limit.rlim_cur >= want) return connections;
  rlimit raised = limit;
  raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? want : std::min(want, limit.rlim_max);
  if (raised.rlim_cur > limit.rlim_cur && setrlimit(RLIMIT_NOFILE, &raised) != 0) raised = limit;
  if (raised.rlim_cur >= want) return connections;
  const rlim_t spare = raised.rlim_cur > 256 ? raised.rlim_cur - 256 : 0;
  const int fitted = int(std::max<rlim_t>(16, spare / 3));
  spdlog::warn("{}: open-file limit {} (hard {}): at most {} connections instead of {} "
               "(--http_max_connections); raise ulimit -n for more",
               name, raised.rlim_cur, limit.rlim_max, fitted, connections);
  return std::min(fitted, connections);
}

}  // namespace

void HttpListener::Impl::SetPhase(MHD_Connection* connection, Phase phase) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  if (info == nullptr || info->socket_context == nullptr) return;
  auto* state = static_cast<ConnectionState*>(info->socket_context);
  std::lock_guard<std::mutex> lock(mu);
  state->phase = phase;
  state->since = absl::Now();
  state->body_bytes = 0;
}

void HttpListener::Impl::AddBodyBytes(MHD_Connection* connection, int64_t bytes) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  if (info == nullptr || info->socket_context == nullptr) return;
  std::lock_guard<std::mutex> lock(mu);
  static_cast<ConnectionState*>(info->socket_context)->body_bytes += bytes;
}

bool HttpListener::Impl::BodyStalled(absl::Duration elapsed, int64_t bytes, bool at_the_cap) const {
  if (options.min_body_bytes_per_s <= 0) return at_the_cap && bytes == 0;
  if (!at_the_cap && elapsed <= kMinBodyRateGrace) return false;
  return double(bytes) < absl::ToDoubleSeconds(elapsed) * double(options.min_body_bytes_per_s);
}

absl::Status HttpListener::Impl::BodyTooSlowError(absl::Duration elapsed, int64_t bytes) const {
  const double seconds = std::max(absl::ToDoubleSeconds(elapsed), 1e-3);
  return HttpTimeoutError(absl::StrCat(
      "the body arrived at ", int64_t(double(bytes) / seconds),
      " bytes/s on average, under --http_min_body_bytes_per_s=", options.min_body_bytes_per_s));
}

// The socket is shut down, not closed, under `mu`: libmicrohttpd sees end of input and closes it
// itself, and it cannot have closed the descriptor yet (its close notification takes `mu`).
void HttpListener::Impl::CutOff(ConnectionState* c, absl::Status why) {
  if (c->phase != Phase::kAwaiting) {
    spdlog::debug("{}: {}; connection closed", options.name, std::string(why.message()));
  }
  if (c->cut_because.ok()) c->cut_because = std::move(why);
  shutdown(c->fd, SHUT_RDWR);
  c->fd = -1;
}

absl::Status HttpListener::Impl::CutReason(MHD_Connection* connection) {
  const MHD_ConnectionInfo* info =
      MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  if (info == nullptr || info->socket_context == nullptr) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu);
  return static_cast<ConnectionState*>(info->socket_context)->cut_because;
}

// Closes connections stuck in the request line or headers (a slowloris trickles them), in a body
// (a timeout, the rate floor) or idle, recording why (CutOff).
void HttpListener::Impl::Sweep() {
  const absl::Duration idle = absl::Seconds(options.idle_timeout_s);
  const absl::Duration header = absl::Seconds(options.header_timeout_s);
  const absl::Duration body = absl::Seconds(options.body_timeout_s);
  const absl::Duration answer = options.answer_timeout_s > 0
                                    ? absl::Seconds(options.answer_timeout_s)
                                    : absl::InfiniteDuration();
  std::unique_lock<std::mutex> lock(mu);
  while (!stop) {
    stop_cv.wait_for(lock, std::chrono::milliseconds(250));
    const absl::Time now = absl::Now();
    for (ConnectionState* c : connections) {
      absl::Duration limit = absl::InfiniteDuration();
      if (c->phase == Phase::kAwaiting) limit = idle + header;  // silent ones: idle timeout
      if (c->phase == Phase::kHeaders) limit = header;
      if (c->phase == Phase::kBody) limit = body + idle;  // trickles are cut off in Body()
      if (c->phase == Phase::kSending) limit = answer;
      // Body() cuts a trickle off when a piece arrives; a body that sends none is cut off here
      // (complete headers, then silence, held connection slots for the whole idle timeout).
      const bool stalled = c->phase == Phase::kBody &&
                           BodyStalled(now - c->since, c->body_bytes, /*at_the_cap=*/false);
      if ((!stalled && now - c->since <= limit) || c->fd < 0) continue;
      switch (c->phase) {
        case Phase::kBody:
          CutOff(c, stalled ? BodyTooSlowError(now - c->since, c->body_bytes)
                            : HttpTimeoutError(absl::StrCat("the body did not arrive within ",
                                                            options.body_timeout_s, " s")));
          break;
        case Phase::kHeaders:
          CutOff(c, HttpTimeoutError(absl::StrCat("the headers did not arrive within ",
                                                  options.header_timeout_s, " s")));
          break;
        case Phase::kSending:
          CutOff(c, HttpTimeoutError(absl::StrCat("the answer was not read within ",
                                                  options.answer_timeout_s, " s")));
          break;
        default:
          CutOff(c, HttpTimeoutError("idle"));
      }
    }
    EvictAtTheCap(now);
  }
}

void HttpListener::Impl::EvictAtTheCap(absl::Time now) {
  // At --http_max_connections new connections wait in the listen backlog, health probes too: a
  // client holding thousands of idle connections kept /v2/health/ready unanswered. As nginx does
  // with keep-alive connections, the ones idle longest (between requests, for at least
  // kMinProgressWindow) are closed to keep a few slots free; a client reconnects when it next
  // sends. Then connections that make no progress: in their headers that long (a slowloris), or
  // in a body arriving under --http_min_body_bytes_per_s (none at all when it is 0) -- complete
  // headers and then silence held the slots as well as idle ones did.
  constexpr absl::Duration kMinProgressWindow = absl::Milliseconds(500);
  const size_t cap = size_t(std::max(options.max_connections, 1));
  const size_t spare = std::max<size_t>(1, cap / 16);
  std::vector<std::pair<int, ConnectionState*>> evictable;  // (0: idle, 1: stalled, connection)
  size_t open = 0;
  for (ConnectionState* c : connections) {
    if (c->fd < 0) continue;
    ++open;
    const absl::Duration in_phase = now - c->since;
    if (in_phase < kMinProgressWindow) continue;
    if (c->phase == Phase::kAwaiting) evictable.emplace_back(0, c);
    if (c->phase == Phase::kHeaders ||
        (c->phase == Phase::kBody && BodyStalled(in_phase, c->body_bytes, /*at_the_cap=*/true))) {
      evictable.emplace_back(1, c);
    }
  }
  if (open + spare <= cap) return;
  std::sort(evictable.begin(), evictable.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second->since < b.second->since;
  });
  for (const auto& [kind, c] : evictable) {
    if (open + spare <= cap) break;
    // A server cut-off, not the client's leaving: a timeout shortened at the cap, counted as
    // DEADLINE_EXCEEDED like the sweeper's (README: a connection cut off before its answer).
    CutOff(c, HttpTimeoutError(
                  absl::StrCat("no progress for ", absl::ToInt64Milliseconds(now - c->since),
                               " ms at --http_max_connections=", cap, " (closed to make room)")));
    --open;
  }
}

namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// libmicrohttpd's own %HH decoding, except that %00 stays as written: the access handler gets
// the path as a C string, so a decoded NUL cut it there ("/v2/health/live%00/admin" was routed,
// and let past the token, as /v2/health/live). Kept, such a path matches no route.
size_t UnescapeKeepingNul(void* /*cls*/, MHD_Connection* /*connection*/, char* s) {
  char* out = s;
  for (const char* in = s; *in != '\0';) {
    int high = -1, low = -1;
    if (in[0] == '%' && (high = HexValue(in[1])) >= 0 && (low = HexValue(in[2])) >= 0 &&
        (high | low) != 0) {
      *out++ = char(high * 16 + low);
      in += 3;
    } else {
      *out++ = *in++;
    }
  }
  *out = '\0';
  return size_t(out - s);
}

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

// Ends a suspended request's PendingAnswer; returns its answer if it came but was never written
// (the connection, resumed for it, closed first: a client gone while its work ran).
std::optional<HttpAnswer> EndPending(HttpListener::Impl* impl, RequestState* st) {
  if (st->pending == nullptr) return std::nullopt;
  std::optional<HttpAnswer> unwritten;
  {
    std::lock_guard<std::mutex> lock(st->pending->mu);
    st->pending->connection = nullptr;
    unwritten = std::move(st->pending->answer);
    st->pending->answer.reset();
  }
  impl->Unsuspend(st->pending);
  return unwritten;
}

// A counted request that ended without an answer: why, for its metrics (and, when its work
// failed, such as CANCELLED for a client that left, the work's reason and a log line).
void ReportUnanswered(HttpListener::Impl* impl, MHD_Connection* connection, const RequestState& st,
                      MHD_RequestTerminationCode code, const std::optional<HttpAnswer>& unwritten) {
  if (!st.begun || st.answered || st.route == nullptr || st.route->route.metric.empty()) return;
  if (unwritten && !unwritten->ok()) {
    impl->Report(st, st.route->route.metric, unwritten->status(), 0, 0);
    return;
  }
  // The request's own cut-off (Body()), else the sweeper's (a timeout, the rate floor, eviction
  // at the cap), else libmicrohttpd's idle timeout; CANCELLED only for a client that left.
  absl::Status why = st.closed_because;
  if (why.ok()) why = impl->CutReason(connection);
  if (why.ok()) {
    why = code == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED
              ? HttpTimeoutError("idle")
              : absl::CancelledError("connection closed");
  }
  if (!impl->options.on_finished) return;
  HttpCallRecord record;
  record.metric = st.route->route.metric;
  record.status = why;
  record.http_status = 0;
  record.seconds = absl::ToDoubleSeconds(absl::Now() - st.started);
  record.bytes_in = st.bytes_in;
  impl->options.on_finished(record);
}

void OnCompleted(void* cls, MHD_Connection* connection, void** request_context,
                 MHD_RequestTerminationCode code) {
  auto* impl = static_cast<HttpListener::Impl*>(cls);
  auto* st = static_cast<RequestState*>(*request_context);
  *request_context = nullptr;
  if (st != nullptr) {
    const std::optional<HttpAnswer> unwritten = EndPending(impl, st);
    ReportUnanswered(impl, connection, *st, code, unwritten);
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
  const std::string text(absl::StripTrailingAsciiWhitespace(line));
  spdlog::debug("{}: libmicrohttpd: {}", static_cast<HttpListener::Impl*>(cls)->options.name,
                LogSafe(text));
}

// libmicrohttpd's fatal errors (it aborts after this returns): one more log line like the rest.
void PanicFromMhd(void* /*cls*/, const char* file, unsigned int line, const char* reason) {
  spdlog::critical("libmicrohttpd fatal error at {}:{}: {}", file ? file : "?", line,
                   LogSafe(reason ? reason : ""));
  spdlog::default_logger()->flush();
  std::abort();
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

  const int max_connections = FitConnections(options.name, options.max_connections);
  std::vector<MHD_OptionItem> items = {
      {MHD_OPTION_EXTERNAL_LOGGER, intptr_t(&LogFromMhd), &impl},  // first: it logs the others
      {MHD_OPTION_SOCK_ADDR, 0, &address},
      {MHD_OPTION_CONNECTION_LIMIT, max_connections, nullptr},
      {MHD_OPTION_PER_IP_CONNECTION_LIMIT, options.max_connections_per_ip, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, options.idle_timeout_s, nullptr},
      // Request line and headers live in this pool (431/414 beyond); the rest buffers the body.
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, intptr_t{options.max_header_bytes} + (16 << 10),
       nullptr},
      {MHD_OPTION_LISTEN_BACKLOG_SIZE, 4096, nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, intptr_t(&OnCompleted), &impl},
      {MHD_OPTION_NOTIFY_CONNECTION, intptr_t(&OnConnection), &impl},
      {MHD_OPTION_URI_LOG_CALLBACK, intptr_t(&OnRequestLine), &impl},
      {MHD_OPTION_UNESCAPE_CALLBACK, intptr_t(&UnescapeKeepingNul), nullptr},
  };
  if (options.threads > 1) items.push_back({MHD_OPTION_THREAD_POOL_SIZE, options.threads, nullptr});
  if (tls) {
    items.push_back({MHD_OPTION_HTTPS_MEM_CERT, 0, impl.tls_cert.data()});
    items.push_back({MHD_OPTION_HTTPS_MEM_KEY, 0, impl.tls_key.data()});
  }
  items.push_back({MHD_OPTION_END, 0, nullptr});
  MHD_set_panic_func(&PanicFromMhd, nullptr);  // process-wide; every listener sets the same
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

void HttpListener::Impl::Unsuspend(const std::shared_ptr<PendingAnswer>& pending) {
  std::lock_guard<std::mutex> lock(mu);
  suspended.erase(pending);
}

void HttpListener::Impl::AnswerSuspended(const HttpAnswer& answer, absl::Duration wait) {
  std::vector<std::shared_ptr<PendingAnswer>> waiting;
  {
    std::lock_guard<std::mutex> lock(mu);
    waiting.assign(suspended.begin(), suspended.end());
  }
  for (const std::shared_ptr<PendingAnswer>& pending : waiting) {
    std::lock_guard<std::mutex> lock(pending->mu);
    if (pending->connection == nullptr || pending->resumed) continue;
    pending->answer = answer;
    pending->resumed = true;
    MHD_resume_connection(pending->connection);
  }
  // Resumed connections are answered on the daemon's threads (Finish), which then unlist them.
  const absl::Time deadline = absl::Now() + wait;
  while (absl::Now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (suspended.empty()) return;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  size_t left = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    left = suspended.size();
  }
  spdlog::warn("{}: {} answer(s) not written before the listener stopped", options.name, left);
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
        for (const ConnectionState* c : impl_->connections)
          busy |= c->phase == Phase::kBusy || c->phase == Phase::kSending;
        if (!busy) break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  // Requests still computing (their work outlived the server's grace period) are answered 503:
  // libmicrohttpd aborts when stopped with a connection suspended.
  impl_->AnswerSuspended(absl::UnavailableError("server shutting down: the answer was not ready"),
                         absl::Seconds(2));
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
