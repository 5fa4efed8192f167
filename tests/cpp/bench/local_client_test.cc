// bench/service/local_client.h against a scripted peer on a Unix socket: replies read with their
// header in one recvmsg (split headers, payloads past the first read's 64 KiB) and the bounded
// spin before blocking (a reply after the spin, the receive timeout, a closed peer).
#include "local_client.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace flashserve::local {
namespace {

using v1::local::EncodeHeader;
using v1::local::FrameHeader;
using v1::local::kHeaderBytes;

std::string Header(uint32_t payload_bytes, uint16_t status = 0) {
  FrameHeader header;
  header.method_or_status = status;
  header.payload_bytes = payload_bytes;
  std::string bytes(kHeaderBytes, '\0');
  EncodeHeader(header, reinterpret_cast<unsigned char*>(bytes.data()));
  return bytes;
}

void WriteAll(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    ASSERT_GT(n, 0);
    done += size_t(n);
  }
}

// Reads one request frame (header + payload) from `fd`.
void ReadRequest(int fd) {
  std::string head(kHeaderBytes, '\0');
  ASSERT_EQ(recv(fd, head.data(), head.size(), MSG_WAITALL), ssize_t(kHeaderBytes));
  const FrameHeader header = v1::local::DecodeHeader(reinterpret_cast<unsigned char*>(head.data()));
  std::string payload(header.payload_bytes, '\0');
  if (!payload.empty()) {
    ASSERT_EQ(recv(fd, payload.data(), payload.size(), MSG_WAITALL), ssize_t(payload.size()));
  }
}

// A listening socket whose one connection is served by `script` on its own thread.
class ScriptedPeer {
 public:
  explicit ScriptedPeer(std::function<void(int)> script) {
    path_ = "/tmp/fs-local-client-test-" + std::to_string(getpid()) + "-" +
            std::to_string(counter_++) + ".sock";
    listener_ = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    path_.copy(address.sun_path, sizeof address.sun_path - 1);
    unlink(path_.c_str());
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(listen(listener_, 1), 0);
    thread_ = std::thread([this, script = std::move(script)] {
      const int fd = accept(listener_, nullptr, nullptr);
      if (fd < 0) return;
      script(fd);
      close(fd);
    });
  }
  ~ScriptedPeer() {
    shutdown(listener_, SHUT_RDWR);
    thread_.join();
    close(listener_);
    unlink(path_.c_str());
  }
  LocalClientOptions Options(int64_t spin_us, int timeout_ms = 10000) const {
    LocalClientOptions options;
    options.socket_path = path_;
    options.spin_us = spin_us;
    options.timeout_ms = timeout_ms;
    return options;
  }

 private:
  static inline int counter_ = 0;
  std::string path_;
  int listener_ = -1;
  std::thread thread_;
};

std::unique_ptr<LocalClient> Connect(const LocalClientOptions& options) {
  CallStatus error;
  std::unique_ptr<LocalClient> client = LocalClient::Connect(options, &error);
  EXPECT_NE(client, nullptr) << error.ToString();
  return client;
}

std::string Pattern(size_t bytes) {
  std::string s(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) s[i] = char('a' + i * 7 % 26);
  return s;
}

TEST(LocalClient, ReplyWithinTheSpinIsReadWhole) {
  const std::string payload = Pattern(1500);
  ScriptedPeer peer([&](int fd) {
    ReadRequest(fd);
    WriteAll(fd, Header(uint32_t(payload.size())) + payload);
  });
  auto client = Connect(peer.Options(/*spin_us=*/1000000));
  std::string reply;
  const CallStatus status = client->CallBytes(Method::kEcho, "ping", &reply);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(reply, payload);
}

TEST(LocalClient, ReplyAfterTheSpinIsReadByTheBlockingWait) {
  const std::string payload = Pattern(100);
  ScriptedPeer peer([&](int fd) {
    ReadRequest(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // far past the 100 us spin
    WriteAll(fd, Header(uint32_t(payload.size())) + payload);
  });
  auto client = Connect(peer.Options(/*spin_us=*/100));
  std::string reply;
  const CallStatus status = client->CallBytes(Method::kEcho, "ping", &reply);
  ASSERT_TRUE(status.ok()) << status.ToString();
  EXPECT_EQ(reply, payload);
}

TEST(LocalClient, SplitHeaderAndPayloadPastTheFirstReadAreReassembled) {
  const std::string payload = Pattern(300000);  // > the 64 KiB read with the header
  for (int64_t spin_us : {int64_t{0}, int64_t{200}}) {
    ScriptedPeer peer([&](int fd) {
      ReadRequest(fd);
      const std::string frame = Header(uint32_t(payload.size())) + payload;
      WriteAll(fd, frame.substr(0, 5));  // part of the header alone
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      WriteAll(fd, frame.substr(5, 20));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      WriteAll(fd, frame.substr(25));
    });
    auto client = Connect(peer.Options(spin_us));
    std::string reply;
    const CallStatus status = client->CallBytes(Method::kEcho, "ping", &reply);
    ASSERT_TRUE(status.ok()) << "spin " << spin_us << ": " << status.ToString();
    EXPECT_TRUE(reply == payload) << "spin " << spin_us << ": " << reply.size() << " bytes";
  }
}

TEST(LocalClient, ErrorFrameAndEmptyReplyKeepTheConnectionUsable) {
  ScriptedPeer peer([](int fd) {
    ReadRequest(fd);
    WriteAll(fd, Header(7, /*status=*/5) + "missing");
    ReadRequest(fd);
    WriteAll(fd, Header(0));
  });
  auto client = Connect(peer.Options(/*spin_us=*/500));
  std::string reply;
  const CallStatus error = client->CallBytes(Method::kEcho, "a", &reply);
  EXPECT_EQ(error.code, 5);
  EXPECT_EQ(error.message, "missing");
  const CallStatus empty = client->CallBytes(Method::kEcho, "b", &reply);
  ASSERT_TRUE(empty.ok()) << empty.ToString();
  EXPECT_TRUE(reply.empty());
}

TEST(LocalClient, ReplyLongerThanItsHeaderIsInternal) {
  ScriptedPeer peer([](int fd) {
    ReadRequest(fd);
    WriteAll(fd, Header(4) + "12345678");  // one write: the client's first read sees all of it
  });
  auto client = Connect(peer.Options(/*spin_us=*/1000000));
  std::string reply;
  EXPECT_EQ(client->CallBytes(Method::kEcho, "ping", &reply).code, 13);
}

TEST(LocalClient, TheReceiveTimeoutStillAppliesAfterTheSpin) {
  ScriptedPeer peer([](int fd) {
    ReadRequest(fd);
    char byte;
    recv(fd, &byte, 1, 0);  // never answers; returns when the client closes
  });
  auto client = Connect(peer.Options(/*spin_us=*/1000, /*timeout_ms=*/100));
  std::string reply;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(client->CallBytes(Method::kEcho, "ping", &reply).code, 4);  // DEADLINE_EXCEEDED
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  client.reset();
}

TEST(LocalClient, APeerThatClosesDuringTheSpinIsUnavailable) {
  ScriptedPeer peer([](int fd) { ReadRequest(fd); });  // closes without answering
  auto client = Connect(peer.Options(/*spin_us=*/1000000));
  std::string reply;
  const CallStatus status = client->CallBytes(Method::kEcho, "ping", &reply);
  EXPECT_EQ(status.code, 14) << status.ToString();
  EXPECT_EQ(client->CallBytes(Method::kEcho, "ping", &reply).code, 14);  // unusable after
}

}  // namespace
}  // namespace flashserve::local
