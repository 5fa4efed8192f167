// The HTTP listener without a server: a request whose answer never comes is answered 503 when
// the listener stops (libmicrohttpd aborted the process when stopped with a connection
// suspended), ambiguous request framing is refused with the connection closed, a request waiting
// for its answer learns when its client has left (peer_gone), and a request the listener cuts off
// is counted with its reason.
#include "common/http_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/utf8.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

// Keeps every reply it is handed and never answers (work that outlives the server).
struct HeldReplies {
  std::mutex mu;
  std::vector<HttpReply> replies;
  std::vector<HttpPeerGone> peers;
  std::atomic<int> count{0};
};

class HoldingUpload final : public HttpUpload {
 public:
  explicit HoldingUpload(std::shared_ptr<HeldReplies> held) : held_(std::move(held)) {}
  absl::Status OnBody(absl::string_view) override { return absl::OkStatus(); }
  void OnComplete(HttpReply reply, HttpPeerGone peer_gone) override {
    std::lock_guard<std::mutex> lock(held_->mu);
    held_->replies.push_back(std::move(reply));
    held_->peers.push_back(std::move(peer_gone));
    held_->count.fetch_add(1);
  }

 private:
  std::shared_ptr<HeldReplies> held_;
};

std::unique_ptr<HttpListener> StartHolding(std::shared_ptr<HeldReplies> held) {
  HttpRoute route;
  route.method = "POST";
  route.pattern = "/work";
  route.max_body_bytes = 1 << 20;
  route.post = [held](const HttpRequest&) -> absl::StatusOr<std::unique_ptr<HttpUpload>> {
    return std::unique_ptr<HttpUpload>(new HoldingUpload(held));
  };
  absl::StatusOr<std::unique_ptr<HttpListener>> listener =
      HttpListener::Start(HttpListenerOptions{}, {route});
  EXPECT_TRUE(listener.ok()) << listener.status();
  return listener.ok() ? *std::move(listener) : nullptr;
}

int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(uint16_t(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  timeval timeout{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  return fd;
}

// Everything the server sends until it closes the connection (or 10 s pass).
std::string ReadAll(int fd) {
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, size_t(n));
  return out;
}

TEST(HttpErrorJson, KeepsWellFormedUtf8AndReplacesOtherBytes) {
  // A model or sequence name the client sent in UTF-8 comes back as it was sent (each byte >= 0x80
  // was escaped as \u00XX, i.e. turned into Latin-1 code points); bytes that are no character
  // become U+FFFD.
  EXPECT_EQ(HttpErrorJson("model \"caf\xC3\xA9\" \xE2\x82\xAC \xF0\x9F\x99\x82"),
            "{\"error\":\"model \\\"caf\xC3\xA9\\\" \xE2\x82\xAC \xF0\x9F\x99\x82\"}");
  EXPECT_EQ(HttpErrorJson("a\xFF"
                          "b"),
            "{\"error\":\"a\\ufffdb\"}");                                  // never a lead byte
  EXPECT_EQ(HttpErrorJson("\xE2\x82"), "{\"error\":\"\\ufffd\\ufffd\"}");  // cut short
  EXPECT_EQ(HttpErrorJson("\xC0\xAF"), "{\"error\":\"\\ufffd\\ufffd\"}");  // overlong '/'
  EXPECT_EQ(HttpErrorJson("\xED\xA0\x80"), "{\"error\":\"\\ufffd\\ufffd\\ufffd\"}");  // a surrogate
  EXPECT_EQ(HttpErrorJson("\xF4\x90\x80\x80"),
            "{\"error\":\"\\ufffd\\ufffd\\ufffd\\ufffd\"}");  // > U+10FFFF
  EXPECT_EQ(HttpErrorJson(std::string("\n\x7F\0\\", 4)),
            "{\"error\":\"\\u000a\\u007f\\u0000\\\\\"}");
}

TEST(HttpErrorJson, CutsAMessageQuotingMegabytesOfClientText) {
  // A 1 MiB region name quoted in a 404 went back whole (several copies of it on the way).
  const std::string message = "no region \"" + std::string(1 << 20, 'Z') + "\"";
  const std::string json = HttpErrorJson(message);
  EXPECT_LT(json.size(), kMaxErrorMessageBytes + 100);
  EXPECT_NE(json.find("... (cut, " + std::to_string(message.size()) + " bytes)\"}"),
            std::string::npos)
      << json.substr(json.size() - 80);
  // A cut never splits a character: U+20AC (3 bytes) across the limit goes whole or not at all.
  const std::string euros = std::string(kMaxErrorMessageBytes - 1, 'a') + "\xE2\x82\xAC";
  EXPECT_EQ(HttpErrorJson(euros).find("\\ufffd"), std::string::npos);
  EXPECT_EQ(HttpErrorJson(std::string(kMaxErrorMessageBytes, 'a')),
            "{\"error\":\"" + std::string(kMaxErrorMessageBytes, 'a') + "\"}");  // not cut
}

TEST(HttpListenerRouting, AnotherMethodOnAServedPathIs405NamingTheAllowedOnes) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);  // POST /work only
  ASSERT_NE(listener, nullptr);
  for (const char* method : {"GET", "DELETE", "PATCH"}) {
    const int fd = Connect(listener->port());
    const std::string request =
        std::string(method) + " /work HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
    const std::string answer = ReadAll(fd);
    close(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 405", 0), 0u) << method << ": " << answer;
    EXPECT_NE(answer.find("Allow: POST\r\n"), std::string::npos) << answer;
  }
  const int fd = Connect(listener->port());
  const std::string unknown = "GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(send(fd, unknown.data(), unknown.size(), 0), ssize_t(unknown.size()));
  const std::string answer = ReadAll(fd);
  close(fd);
  EXPECT_EQ(answer.rfind("HTTP/1.1 404", 0), 0u) << answer;
  EXPECT_EQ(held->count.load(), 0);
}

TEST(HttpListenerStop, AnswersARequestStillWaitingFor503) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);
  ASSERT_NE(listener, nullptr);
  const int fd = Connect(listener->port());
  const std::string request = "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
  ASSERT_EQ(send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
  for (int i = 0; i < 1000 && held->count.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(held->count.load(), 1);

  listener->Stop(absl::Milliseconds(50));  // aborted the process before
  const std::string answer = ReadAll(fd);
  close(fd);
  EXPECT_EQ(answer.rfind("HTTP/1.1 503", 0), 0u) << answer;
  EXPECT_NE(answer.find("server shutting down"), std::string::npos) << answer;
  // The work finishing later finds the request over.
  std::lock_guard<std::mutex> lock(held->mu);
  held->replies[0](HttpResponse::Json(200, "{}"));
}

TEST(HttpListenerFraming, AmbiguousBodiesAreRefusedAndTheConnectionClosed) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);
  ASSERT_NE(listener, nullptr);
  const std::string smuggled = "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
  const std::string cases[] = {
      // The second request rides in the body that the second Content-Length claims.
      "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: " +
          std::to_string(2 + smuggled.size()) + "\r\n\r\n{}" + smuggled,
      "POST /work HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"
      "2\r\n{}\r\n0\r\n\r\n" +
          smuggled,
      // Codings other than chunked alone: the body has no knowable end (libmicrohttpd waited
      // for the client to close), and two fields read differently by a proxy.
      "POST /work HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
      "POST /work HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
      "POST /work HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n"
      "2\r\n{}\r\n0\r\n\r\n"};
  for (const std::string& request : cases) {
    const int fd = Connect(listener->port());
    ASSERT_EQ(send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
    const std::string answer = ReadAll(fd);  // returns: the server closed the connection
    close(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 400", 0), 0u) << answer;
    EXPECT_NE(answer.find("request framing"), std::string::npos) << answer;
    EXPECT_EQ(answer.find("HTTP/1.1", 1), std::string::npos) << "a second answer: " << answer;
  }
  EXPECT_EQ(held->count.load(), 0);  // neither request, nor the smuggled one, was served
  // Equal duplicates and a plain body still work (answered when the held reply is called).
  const int fd = Connect(listener->port());
  const std::string plain = "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
  ASSERT_EQ(send(fd, plain.data(), plain.size(), 0), ssize_t(plain.size()));
  for (int i = 0; i < 1000 && held->count.load() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(held->count.load(), 1);
  {
    std::lock_guard<std::mutex> lock(held->mu);
    held->replies[0](HttpResponse::Json(200, R"({"ok":1})"));
  }
  char buf[512];
  const ssize_t n = recv(fd, buf, sizeof(buf), 0);
  close(fd);
  ASSERT_GT(n, 0);
  EXPECT_EQ(std::string(buf, size_t(n)).rfind("HTTP/1.1 200", 0), 0u);
}

// Sends one POST /work and waits until its upload holds the reply (the connection suspended).
void PostAndWaitHeld(int fd, const HeldReplies& held, int count) {
  const std::string request = "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
  ASSERT_EQ(send(fd, request.data(), request.size(), 0), ssize_t(request.size()));
  for (int i = 0; i < 1000 && held.count.load() < count; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(held.count.load(), count);
}

// Whether `peer_gone` turns true within 5 s (the kernel sees the close at once; a loaded machine
// may delay this thread, never the answer).
bool BecomesGone(const HttpPeerGone& peer_gone) {
  for (int i = 0; i < 1000; ++i) {
    if (peer_gone()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

HttpPeerGone HeldPeer(HeldReplies* held, int i) {
  std::lock_guard<std::mutex> lock(held->mu);
  return held->peers[size_t(i)];
}

void Reply(HeldReplies* held, int i, HttpAnswer answer) {
  std::lock_guard<std::mutex> lock(held->mu);
  held->replies[size_t(i)](std::move(answer));
}

TEST(HttpListenerPeerGone, AClosedOrResetConnectionIsGoneAndItsLateAnswerIsHarmless) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);
  ASSERT_NE(listener, nullptr);
  for (const bool reset : {false, true}) {
    const int n = held->count.load() + 1;
    const int fd = Connect(listener->port());
    PostAndWaitHeld(fd, *held, n);
    const HttpPeerGone peer_gone = HeldPeer(held.get(), n - 1);
    EXPECT_FALSE(peer_gone());
    if (reset) {  // SO_LINGER 0: close sends RST instead of FIN
      linger hard{1, 0};
      setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof(hard));
    }
    close(fd);
    EXPECT_TRUE(BecomesGone(peer_gone)) << (reset ? "reset" : "closed");
    // The work's answer comes later: written to nobody, the connection then closed; still gone.
    Reply(held.get(), n - 1, absl::CancelledError("cancelled by the client"));
    EXPECT_TRUE(BecomesGone(peer_gone));
  }
  // The listener still serves, and stops without waiting for the closed ones.
  const int fd = Connect(listener->port());
  PostAndWaitHeld(fd, *held, 3);
  Reply(held.get(), 2, HttpResponse::Json(200, R"({"ok":1})"));
  const std::string answer = [&] {
    char buf[512];
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, size_t(n)) : std::string();
  }();
  EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
  close(fd);
  listener->Stop(absl::Seconds(1));
}

TEST(HttpListenerPeerGone, PendingBytesAreNotGoneButAFinAfterThemIs) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);
  ASSERT_NE(listener, nullptr);
  const int fd = Connect(listener->port());
  PostAndWaitHeld(fd, *held, 1);
  const HttpPeerGone peer_gone = HeldPeer(held.get(), 0);
  // A pipelined next request waits unread while the connection is suspended: the client is there.
  const std::string next = "GET /next HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(send(fd, next.data(), next.size(), 0), ssize_t(next.size()));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(peer_gone());
  // Bytes then the end of input (a TLS client's close_notify, then FIN): gone, bytes or not.
  shutdown(fd, SHUT_WR);
  EXPECT_TRUE(BecomesGone(peer_gone));
  Reply(held.get(), 0, absl::CancelledError("cancelled by the client"));
  close(fd);
  listener->Stop(absl::Seconds(1));
}

TEST(HttpListenerPeerGone, AnAnsweredRequestIsOver) {
  auto held = std::make_shared<HeldReplies>();
  std::unique_ptr<HttpListener> listener = StartHolding(held);
  ASSERT_NE(listener, nullptr);
  const int fd = Connect(listener->port());
  PostAndWaitHeld(fd, *held, 1);
  const HttpPeerGone peer_gone = HeldPeer(held.get(), 0);
  Reply(held.get(), 0, HttpResponse::Json(200, R"({"ok":1})"));
  char buf[512];
  ASSERT_GT(recv(fd, buf, sizeof(buf), 0), 0);
  // The connection stays open (keep-alive), but its socket is libmicrohttpd's again and may be
  // closed and its number reused: never looked at, the request counts as over.
  EXPECT_TRUE(BecomesGone(peer_gone));
  close(fd);
  listener->Stop(absl::Seconds(1));
}

// A request the listener cuts off unanswered is counted with the listener's reason, not as
// CANCELLED (a client that left): at the connection cap, connections whose body never started
// are evicted after 0.5 s without progress, DEADLINE_EXCEEDED naming the cap (audit: they were
// counted CANCELLED, "connection closed"). The ones their client then closes stay CANCELLED.
TEST(HttpListenerCutOff, ARequestEvictedAtTheCapCountsDeadlineExceeded) {
  struct Records {
    std::mutex mu;
    std::vector<HttpCallRecord> records;
    size_t size() {
      std::lock_guard<std::mutex> lock(mu);
      return records.size();
    }
  };
  auto records = std::make_shared<Records>();
  auto held = std::make_shared<HeldReplies>();
  HttpRoute route;
  route.method = "POST";
  route.pattern = "/work";
  route.metric = "Work";
  route.max_body_bytes = 1 << 20;
  route.post = [held](const HttpRequest&) -> absl::StatusOr<std::unique_ptr<HttpUpload>> {
    return std::unique_ptr<HttpUpload>(new HoldingUpload(held));
  };
  HttpListenerOptions options;
  options.threads = 1;  // the whole cap on one epoll thread: every connection is accepted
  options.max_connections = 16;
  options.min_body_bytes_per_s = 0;  // no rate floor: only the eviction cuts these off
  options.on_finished = [records](const HttpCallRecord& record) {
    std::lock_guard<std::mutex> lock(records->mu);
    records->records.push_back(record);
  };
  absl::StatusOr<std::unique_ptr<HttpListener>> listener = HttpListener::Start(options, {route});
  ASSERT_TRUE(listener.ok()) << listener.status();
  const std::string head = "POST /work HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n";
  std::vector<int> fds;
  for (int i = 0; i < 16; ++i) {
    fds.push_back(Connect((*listener)->port()));
    ASSERT_EQ(send(fds.back(), head.data(), head.size(), 0), ssize_t(head.size()));
  }
  for (int i = 0; i < 2000 && records->size() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(records->size(), 1u) << "nothing evicted at the cap within 10 s";
  absl::SleepFor(absl::Milliseconds(300));  // one more sweep: it evicts nothing more (room made)
  const size_t evicted = records->size();
  for (int fd : fds) close(fd);
  for (int i = 0; i < 2000 && records->size() < 16; ++i) absl::SleepFor(absl::Milliseconds(5));
  (*listener)->Stop(absl::Seconds(1));
  std::lock_guard<std::mutex> lock(records->mu);
  ASSERT_EQ(records->records.size(), 16u);
  for (size_t i = 0; i < records->records.size(); ++i) {
    const HttpCallRecord& r = records->records[i];
    EXPECT_EQ(r.metric, "Work");
    EXPECT_EQ(r.http_status, 0);  // unanswered
    if (i < evicted) {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
      EXPECT_NE(r.status.message().find("--http_max_connections=16"), absl::string_view::npos)
          << r.status;
    } else {
      EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
    }
  }
  EXPECT_EQ(held->count.load(), 0);  // no body came: no work started
}

}  // namespace
}  // namespace flashserve
