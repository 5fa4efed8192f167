// edge/local's frames: header checks (before any allocation), the reader's deadlines over a real
// socket pair (a trickling peer is cut off, an idle one may wait), and writev'd responses.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "edge/local/frame_check.h"
#include "edge/local/frame_io.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

namespace local = v1::local;

std::string Frame(uint16_t method, const std::string& payload, uint16_t flags = 0,
                  uint32_t magic = local::kMagic) {
  local::FrameHeader header;
  header.magic = magic;
  header.method_or_status = method;
  header.flags = flags;
  header.payload_bytes = uint32_t(payload.size());
  unsigned char bytes[local::kHeaderBytes];
  local::EncodeHeader(header, bytes);
  return std::string(reinterpret_cast<char*>(bytes), sizeof(bytes)) + payload;
}

TEST(FrameCheckTest, RefusesBadHeadersNamingWhy) {
  local::FrameHeader header;
  std::string_view payload;
  EXPECT_TRUE(SplitRequestFrame(Frame(3, "abc"), 3, &header, &payload).ok());
  EXPECT_EQ(payload, "abc");
  const struct {
    std::string frame;
    int64_t limit;
    absl::StatusCode code;
    const char* words;
  } bad[] = {
      {Frame(3, "abc", 0, 0x12345678), 100, absl::StatusCode::kInvalidArgument, "magic"},
      {Frame(0, "abc"), 100, absl::StatusCode::kInvalidArgument, "unknown method"},
      {Frame(6, "abc"), 100, absl::StatusCode::kInvalidArgument, "unknown method"},
      {Frame(2, "abc", 1), 100, absl::StatusCode::kInvalidArgument, "flags"},
      {Frame(2, "abcd"), 3, absl::StatusCode::kResourceExhausted, "local_max_frame_bytes"},
      {Frame(2, "abc").substr(0, 15), 100, absl::StatusCode::kInvalidArgument, "16-byte header"},
      {Frame(2, "abc") + "x", 100, absl::StatusCode::kInvalidArgument, "4 follow"},
  };
  for (const auto& b : bad) {
    const absl::Status s = SplitRequestFrame(b.frame, b.limit, &header, &payload);
    EXPECT_EQ(s.code(), b.code) << s;
    EXPECT_NE(s.message().find(b.words), std::string::npos) << s;
  }
  local::FrameHeader reserved;
  reserved.method_or_status = 2;
  reserved.reserved = 7;
  EXPECT_FALSE(CheckRequestHeader(reserved, 100).ok());
}

class FrameReaderTest : public testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds_), 0); }
  void TearDown() override {
    close(fds_[0]);
    if (fds_[1] >= 0) close(fds_[1]);
  }
  void Send(const std::string& bytes) {
    ASSERT_EQ(write(fds_[1], bytes.data(), bytes.size()), ssize_t(bytes.size()));
  }
  // A thread reading what the server side writes into *received, until `bytes` came or the end.
  std::thread ReadBack(std::string* received, size_t bytes = std::string::npos) {
    return std::thread([this, received, bytes] {
      char buffer[65536];
      while (received->size() < bytes) {
        const ssize_t n = read(fds_[1], buffer, sizeof(buffer));
        if (n <= 0) return;
        received->append(buffer, size_t(n));
      }
    });
  }
  int fds_[2] = {-1, -1};
};

TEST_F(FrameReaderTest, ReadsAFrameThatArrivesInPieces) {
  const std::string frame = Frame(2, std::string(5000, 'p'));
  std::thread writer([&] {
    for (size_t at = 0; at < frame.size(); at += 700) {
      Send(frame.substr(at, 700));
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
  FrameReader reader(fds_[0], 1 << 20, absl::Seconds(5));
  local::FrameHeader header;
  absl::Status error;
  ASSERT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kFrame) << error;
  std::string payload(header.payload_bytes, '\0');
  EXPECT_TRUE(reader.ReadPayload(payload.data(), payload.size()).ok());
  EXPECT_EQ(payload, std::string(5000, 'p'));
  writer.join();
}

TEST_F(FrameReaderTest, TricklingPeerIsCutOffAtTheDeadline) {
  Send(Frame(2, "abc").substr(0, 5));  // a started header that never completes
  FrameReader reader(fds_[0], 100, absl::Milliseconds(100));
  local::FrameHeader header;
  absl::Status error;
  const absl::Time start = absl::Now();
  EXPECT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kRefused);
  EXPECT_EQ(error.code(), absl::StatusCode::kDeadlineExceeded) << error;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST_F(FrameReaderTest, PayloadMustArriveWithinTheHeadersDeadline) {
  Send(Frame(2, std::string(100, 'x')).substr(0, 60));
  FrameReader reader(fds_[0], 1000, absl::Milliseconds(100));
  local::FrameHeader header;
  absl::Status error;
  ASSERT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kFrame) << error;
  std::string payload(header.payload_bytes, '\0');
  EXPECT_EQ(reader.ReadPayload(payload.data(), payload.size()).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(FrameReaderTest, IdlePeerMayWaitAndClosingBetweenFramesIsClean) {
  FrameReader reader(fds_[0], 100, absl::Milliseconds(50));
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // idle longer than the timeout
    Send(Frame(2, "a"));
    close(fds_[1]);
    fds_[1] = -1;
  });
  local::FrameHeader header;
  absl::Status error;
  ASSERT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kFrame) << error;
  char byte = 0;
  EXPECT_TRUE(reader.ReadPayload(&byte, 1).ok());
  late.join();
  EXPECT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kClosed);
}

TEST_F(FrameReaderTest, PeerLeavingMidHeaderIsRefused) {
  Send(Frame(2, "abc").substr(0, 9));
  close(fds_[1]);
  fds_[1] = -1;
  FrameReader reader(fds_[0], 100, absl::Seconds(5));
  local::FrameHeader header;
  absl::Status error;
  EXPECT_EQ(reader.ReadHeader(&header, &error), FrameReader::Result::kRefused);
  EXPECT_EQ(error.code(), absl::StatusCode::kUnavailable) << error;
}

TEST_F(FrameReaderTest, ErrorFramesCutMessagesQuotingClientText) {
  const std::string message = "no region \"" + std::string(1 << 20, 'Z') + "\"";
  std::string received;
  std::thread reader = ReadBack(&received);
  EXPECT_TRUE(WriteErrorFrame(fds_[0], absl::NotFoundError(message)).ok());
  shutdown(fds_[0], SHUT_WR);
  reader.join();
  ASSERT_GT(received.size(), size_t{local::kHeaderBytes});
  const std::string text = received.substr(local::kHeaderBytes);
  EXPECT_LT(text.size(), size_t{5000});
  EXPECT_NE(text.find("(cut, " + std::to_string(message.size()) + " bytes)"), std::string::npos);
}

TEST_F(FrameReaderTest, WriteFrameSendsEveryPieceInOrder) {
  const std::string big(3 << 20, 'b');  // larger than the socket buffer: partial writes
  const std::string small = "tail";
  const iovec pieces[] = {{const_cast<char*>(small.data()), 2},
                          {const_cast<char*>(big.data()), big.size()},
                          {nullptr, 0},
                          {const_cast<char*>(small.data()) + 2, 2}};
  std::string received;
  std::thread reader = ReadBack(&received, local::kHeaderBytes + big.size() + 4);
  EXPECT_TRUE(WriteFrame(fds_[0], 0, pieces, 4).ok());
  reader.join();
  ASSERT_EQ(received.size(), local::kHeaderBytes + big.size() + 4);
  const local::FrameHeader header =
      local::DecodeHeader(reinterpret_cast<const unsigned char*>(received.data()));
  EXPECT_EQ(header.magic, local::kMagic);
  EXPECT_EQ(header.method_or_status, 0);
  EXPECT_EQ(header.payload_bytes, big.size() + 4);
  EXPECT_EQ(received.substr(local::kHeaderBytes, 2), "ta");
  EXPECT_EQ(received.substr(received.size() - 2), "il");
}

}  // namespace
}  // namespace flashserve
