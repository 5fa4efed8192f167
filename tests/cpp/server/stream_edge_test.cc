// Reassembly, header validation, session ids, chunk parsing and Download chunk sizes of the
// striped streaming edge (pure logic, no gRPC server).
#include <atomic>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "edge/grpc/stream_chunk.h"
#include "edge/grpc/stream_session.h"
#include "edge/grpc/stream_transfer.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

// What a CPU server accepts (the runtime's limits, which sessions are checked against).
ValidationLimits Accepted() {
  ValidationLimits limits;
  limits.dtypes = {kernels::DType::kFloat16, kernels::DType::kBFloat16, kernels::DType::kFloat32};
  return limits;
}

v1::AttentionRequest Header(int64_t b = 1, int64_t s = 4, int64_t h = 2, int64_t d = 8,
                            bool lse = false) {
  v1::AttentionRequest request;
  for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    t->set_dtype(v1::BFLOAT16);
    for (int64_t x : {b, s, h, d}) t->add_shape(x);
  }
  request.set_return_lse(lse);
  return request;
}

std::string Serialize(const std::string& session, int tensor, int64_t offset,
                      const std::string& data) {
  v1::AttentionChunk chunk;
  chunk.set_session_id(session);
  chunk.set_tensor(static_cast<v1::TensorName>(tensor));
  chunk.set_offset(offset);
  chunk.set_data(data);
  return chunk.SerializeAsString();
}

// Parses `bytes` into `session` the way the Upload handler does.
absl::Status Feed(StreamSession* session, const std::string& bytes, ChunkHeader* header) {
  google::protobuf::io::ArrayInputStream in(bytes.data(), int(bytes.size()), 7);  // odd blocks
  bool reserved = false;
  absl::Status s = ParseChunk(
      &in,
      [&](const ChunkHeader& h) -> absl::StatusOr<char*> {
        absl::StatusOr<char*> dest = session->Reserve(h.tensor, h.offset, h.length);
        reserved = dest.ok();
        return dest;
      },
      header);
  if (reserved) session->Commit(s.ok() ? header->length : 0);
  return s;
}

TEST(RangeSetTest, InsertsMergesAndRejectsOverlap) {
  RangeSet set;
  EXPECT_TRUE(set.Insert(0, 10).ok());
  EXPECT_TRUE(set.Insert(20, 30).ok());
  EXPECT_TRUE(set.Insert(10, 20).ok());  // fills the gap: merged into one range
  EXPECT_EQ(set.size(), 1u);
  EXPECT_EQ(set.covered(), 30);
  EXPECT_EQ(set.Insert(29, 31).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(set.Insert(-5, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(set.Insert(5, 6).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(set.Insert(30, 30).ok());  // empty
  EXPECT_TRUE(set.Insert(40, 50).ok());
  EXPECT_EQ(set.Insert(35, 45).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(set.covered(), 40);
}

TEST(RangeSetTest, HoldsAtMostKMaxRangesSeparateRanges) {
  RangeSet set;
  for (size_t i = 0; i < RangeSet::kMaxRanges; ++i) {
    ASSERT_TRUE(set.Insert(int64_t(2 * i), int64_t(2 * i + 1)).ok()) << i;
  }
  const int64_t end = int64_t(2 * RangeSet::kMaxRanges);
  const absl::Status one_more = set.Insert(end + 1, end + 2);
  EXPECT_EQ(one_more.code(), absl::StatusCode::kResourceExhausted) << one_more;
  EXPECT_EQ(set.size(), RangeSet::kMaxRanges);
  EXPECT_TRUE(set.Insert(end - 1, end).ok());  // touches the last range: merged, not a new one
  EXPECT_TRUE(set.Insert(1, 2).ok());          // fills a gap: two ranges become one
  EXPECT_EQ(set.size(), RangeSet::kMaxRanges - 1);
  EXPECT_TRUE(set.Insert(end + 1, end + 2).ok());  // room again
}

TEST(CheckRangeTest, NeverOverflows) {
  EXPECT_TRUE(CheckRange(0, 10, 10, "q").ok());
  EXPECT_TRUE(CheckRange(10, 0, 10, "q").ok());
  EXPECT_FALSE(CheckRange(1, 10, 10, "q").ok());
  EXPECT_FALSE(CheckRange(-1, 1, 10, "q").ok());
  EXPECT_FALSE(CheckRange(0, -1, 10, "q").ok());
  EXPECT_FALSE(CheckRange(INT64_MAX, INT64_MAX, 10, "q").ok());
  EXPECT_FALSE(CheckRange(5, INT64_MAX, 10, "q").ok());
}

TEST(SessionTableTest, ReassemblesOutOfOrderChunksExactly) {
  SessionTable table(StreamLimits{}, Accepted());
  auto session = table.Open(Header());
  ASSERT_TRUE(session.ok()) << session.status();
  StreamSession& s = **session;
  const int64_t bytes = 1 * 4 * 2 * 8 * 2;  // 128
  EXPECT_EQ(s.input_bytes(), 3 * bytes);
  std::string want[3];
  for (int t = 0; t < 3; ++t) {
    for (int64_t i = 0; i < bytes; ++i) want[t].push_back(char(i * 7 + t));
  }
  // Uneven pieces in reverse order, interleaved over the tensors.
  for (int64_t off : {100, 37, 0}) {
    for (int t = 0; t < 3; ++t) {
      const int64_t end = off == 100 ? bytes : off == 37 ? 100 : 37;
      ChunkHeader header;
      ASSERT_TRUE(Feed(&s, Serialize(s.id(), t + 1, off, want[t].substr(size_t(off), size_t(end - off))),
                       &header)
                      .ok());
      EXPECT_EQ(header.session_id, s.id());
      EXPECT_EQ(header.length, end - off);
    }
    if (off != 0) {
      EXPECT_EQ(s.BeginCompute().code(), absl::StatusCode::kFailedPrecondition);
    }
  }
  EXPECT_EQ(std::string(s.io()->q(), size_t(bytes)), want[0]);
  EXPECT_EQ(std::string(s.io()->k(), size_t(bytes)), want[1]);
  EXPECT_EQ(std::string(s.io()->v(), size_t(bytes)), want[2]);
  EXPECT_EQ(s.bytes_received(), 3 * bytes);
  EXPECT_TRUE(s.BeginCompute().ok());
  // No uploads once computing.
  ChunkHeader header;
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 1, 0, "x"), &header).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SessionTableTest, RejectsBadChunksWithoutWriting) {
  SessionTable table(StreamLimits{}, Accepted());
  auto session = table.Open(Header());
  ASSERT_TRUE(session.ok());
  StreamSession& s = **session;
  // The buffers are not zero-filled: remember what is there and check nothing was written.
  std::memset(s.io()->q(), 0x5a, 128);
  const std::string before(s.io()->q(), 128);
  ChunkHeader h;
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 1, 120, std::string(9, 'a')), &h).code(),
            absl::StatusCode::kInvalidArgument);  // past the end
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 1, -8, std::string(9, 'a')), &h).code(),
            absl::StatusCode::kInvalidArgument);  // negative offset
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 4, 0, "a"), &h).code(),
            absl::StatusCode::kInvalidArgument);  // OUT is not an input
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 0, 0, "a"), &h).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.io()->q(), 128), before);
  EXPECT_TRUE(Feed(&s, Serialize(s.id(), 1, 0, std::string(16, 'a')), &h).ok());
  EXPECT_EQ(Feed(&s, Serialize(s.id(), 1, 8, std::string(16, 'b')), &h).code(),
            absl::StatusCode::kInvalidArgument);  // overlap
  EXPECT_EQ(std::string(s.io()->q(), 24), std::string(16, 'a') + std::string(8, '\x5a'));
  EXPECT_EQ(s.bytes_received(), 16);
}

TEST(ParseChunkTest, RejectsMalformedMessages) {
  auto parse = [](const std::string& bytes) {
    google::protobuf::io::ArrayInputStream in(bytes.data(), int(bytes.size()));
    ChunkHeader header;
    char sink[64];
    return ParseChunk(
        &in, [&](const ChunkHeader& h) -> absl::StatusOr<char*> {
          if (h.length > 64) return absl::InvalidArgumentError("too long");
          return sink;
        },
        &header);
  };
  const std::string good = Serialize("s", 1, 0, "abcd");
  EXPECT_TRUE(parse(good).ok());
  EXPECT_FALSE(parse(good.substr(0, good.size() - 1)).ok());  // truncated data
  EXPECT_FALSE(parse(Serialize("s", 1, 0, "")).ok());         // proto3 drops empty data: no data field
  EXPECT_FALSE(parse(std::string("\x22\x05" "ab", 4)).ok());  // length past the end
  EXPECT_FALSE(parse(good + std::string("\x10\x01", 2)).ok());  // tensor after data
  EXPECT_FALSE(parse(std::string("\x00", 1)).ok());            // tag 0
  std::string with_unknown = std::string("\x48\x05", 2) + good;  // field 9 varint: skipped
  EXPECT_TRUE(parse(with_unknown).ok());
}

TEST(SessionTableTest, EnforcesLimitsAndReapsIdleSessions) {
  StreamLimits limits;
  limits.max_sessions = 2;
  limits.max_session_bytes = 1000;
  limits.idle_timeout = std::chrono::milliseconds(50);
  SessionTable table(limits, Accepted());
  EXPECT_EQ(table.Open(Header(1, 64, 2, 8)).status().code(),
            absl::StatusCode::kResourceExhausted);  // 3 x 2048 bytes > 1000
  v1::AttentionRequest with_data = Header();
  with_data.mutable_q()->set_data("x");
  EXPECT_EQ(table.Open(with_data).status().code(), absl::StatusCode::kInvalidArgument);
  v1::AttentionRequest rank3 = Header();
  rank3.mutable_k()->mutable_shape()->RemoveLast();
  EXPECT_EQ(table.Open(rank3).status().code(), absl::StatusCode::kInvalidArgument);
  v1::AttentionRequest zero = Header();
  zero.mutable_v()->set_shape(1, 0);
  EXPECT_EQ(table.Open(zero).status().code(), absl::StatusCode::kInvalidArgument);
  v1::AttentionRequest huge = Header();
  huge.mutable_q()->set_shape(1, int64_t{1} << 20);
  huge.mutable_q()->set_shape(2, int64_t{1} << 20);
  EXPECT_EQ(table.Open(huge).status().code(), absl::StatusCode::kResourceExhausted);
  huge.mutable_q()->set_shape(1, int64_t{1} << 40);  // past int32: malformed, as in Attention
  EXPECT_EQ(table.Open(huge).status().code(), absl::StatusCode::kInvalidArgument);

  auto a = table.Open(Header());
  auto b = table.Open(Header());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->id(), (*b)->id());
  EXPECT_EQ(table.Open(Header()).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(table.size(), 2u);
  EXPECT_GT(table.total_bytes(), 0);
  // A computing session is never reaped; the idle one is, and its uploads then fail.
  ASSERT_TRUE((*a)->Reserve(1, 0, 128).ok());
  (*a)->Commit(128);
  ASSERT_TRUE((*a)->Reserve(2, 0, 128).ok());
  (*a)->Commit(128);
  ASSERT_TRUE((*a)->Reserve(3, 0, 128).ok());
  (*a)->Commit(128);
  ASSERT_TRUE((*a)->BeginCompute().ok());
  EXPECT_EQ(table.Reap(std::chrono::steady_clock::now() + std::chrono::seconds(1)), 1);
  EXPECT_EQ(table.size(), 1u);
  EXPECT_EQ(table.Find((*b)->id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*b)->Reserve(1, 0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(table.Find((*a)->id()).ok());
  table.Erase((*a)->id());
  EXPECT_EQ(table.size(), 0u);
  EXPECT_GT(table.total_bytes(), 0);  // the sessions are still held here
  a = absl::CancelledError("let go");
  b = absl::CancelledError("let go");
  EXPECT_EQ(table.total_bytes(), 0);
}

// A session closed or reaped while something still holds it (an Upload copying into it, Download
// slices gRPC has not sent) keeps its memory, so it keeps its slot and bytes until it is let go.
TEST(SessionTableTest, AClosedSessionKeepsItsRoomUntilItIsLetGo) {
  StreamLimits limits;
  limits.max_sessions = 1;
  limits.idle_timeout = std::chrono::milliseconds(1);
  SessionTable table(limits, Accepted());
  for (bool reaped : {false, true}) {
    SCOPED_TRACE(reaped ? "reaped" : "erased");
    absl::StatusOr<std::shared_ptr<StreamSession>> opened = table.Open(Header());
    ASSERT_TRUE(opened.ok()) << opened.status();
    std::shared_ptr<StreamSession> held = std::move(*opened);
    const int64_t bytes = held->accounted_bytes();
    if (reaped) {
      EXPECT_EQ(table.Reap(std::chrono::steady_clock::now() + std::chrono::seconds(1)), 1);
    } else {
      table.Erase(held->id());
    }
    EXPECT_EQ(table.size(), 0u);
    EXPECT_EQ(table.total_bytes(), bytes);
    EXPECT_EQ(table.Open(Header()).status().code(), absl::StatusCode::kResourceExhausted);
    held.reset();
    EXPECT_EQ(table.total_bytes(), 0);
  }
  EXPECT_TRUE(table.Open(Header()).ok());
}

TEST(SessionTableTest, DownloadsEachOutputByteOnce) {
  SessionTable table(StreamLimits{}, Accepted());
  auto session = table.Open(Header(1, 4, 2, 8, /*lse=*/true));
  ASSERT_TRUE(session.ok());
  StreamSession& s = **session;
  EXPECT_EQ(s.ReserveDownload(v1::TENSOR_OUT, 0, 0).status().code(),
            absl::StatusCode::kFailedPrecondition);  // before Compute
  for (int t = 1; t <= 3; ++t) {
    ASSERT_TRUE(s.Reserve(t, 0, 128).ok());
    s.Commit(128);
  }
  ASSERT_TRUE(s.BeginCompute().ok());
  s.response.mutable_out()->set_data(std::string(128, 'o'));
  s.response.mutable_lse()->set_data(std::string(32, 'l'));
  s.EndCompute(true);
  auto first = s.ReserveDownload(v1::TENSOR_OUT, 0, 64);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->second, 64);
  EXPECT_EQ(s.ReserveDownload(v1::TENSOR_OUT, 32, 64).status().code(),
            absl::StatusCode::kInvalidArgument);  // overlap
  EXPECT_EQ(s.ReserveDownload(v1::TENSOR_OUT, 64, 65).status().code(),
            absl::StatusCode::kInvalidArgument);  // past the end
  EXPECT_EQ(s.ReserveDownload(v1::TENSOR_Q, 0, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto rest = s.ReserveDownload(v1::TENSOR_OUT, 64, 0);  // 0: to the end
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(rest->second, 64);
  EXPECT_FALSE(s.FullyDownloaded());
  ASSERT_TRUE(s.ReserveDownload(v1::TENSOR_LSE, 0, 0).ok());
  EXPECT_TRUE(s.FullyDownloaded());
}

// 0 is the default; [4 KiB, 64 MiB] is used as given; the rest is refused, not clamped.
TEST(DownloadChunkBytesTest, DefaultRangeAndRefusals) {
  EXPECT_EQ(*DownloadChunkBytes(0), int64_t{4} << 20);
  EXPECT_EQ(*DownloadChunkBytes(4096), 4096);
  EXPECT_EQ(*DownloadChunkBytes(int64_t{64} << 20), int64_t{64} << 20);
  for (int64_t bad : {int64_t{-1}, int64_t{1}, int64_t{4095}, (int64_t{64} << 20) + 1,
                      std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()}) {
    absl::StatusOr<int64_t> chunk = DownloadChunkBytes(bad);
    EXPECT_EQ(chunk.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(chunk.status().message(),
              absl::StrCat("DownloadRequest.chunk_bytes: ", bad,
                           " is outside [4096, 67108864] (0: the default, 4194304)"));
  }
}

TEST(AppendChunkHeaderTest, MatchesProtobuf) {
  std::string header;
  AppendChunkHeader(v1::TENSOR_OUT, 300, 5, &header);
  header += "hello";
  v1::AttentionChunk chunk;
  ASSERT_TRUE(chunk.ParseFromString(header));
  EXPECT_EQ(chunk.tensor(), v1::TENSOR_OUT);
  EXPECT_EQ(chunk.offset(), 300);
  EXPECT_EQ(chunk.data(), "hello");
}

// Counts the page-locked (here: heap) allocations a pool makes.
class CountingAllocator final : public HostAllocator {
 public:
  explicit CountingAllocator(std::atomic<int>* count) : count_(count) {}
  void* Allocate(size_t bytes) override {
    count_->fetch_add(1);
    return heap_.Allocate(bytes);
  }
  void Free(void* pointer) override { heap_.Free(pointer); }

 private:
  std::atomic<int>* count_;
  HeapAllocator heap_;
};

// Headers the native API refuses; OpenSession must refuse each before allocating anything.
std::vector<std::pair<const char*, v1::AttentionRequest>> BadHeaders() {
  std::vector<std::pair<const char*, v1::AttentionRequest>> bad;
  v1::AttentionRequest h = Header(1, 16, 3, 8);
  h.mutable_k()->set_shape(2, 2);
  h.mutable_v()->set_shape(2, 2);
  bad.emplace_back("heads_q % heads_kv != 0", h);
  h = Header(1, 16, 2, 300);
  bad.emplace_back("head_dim over the maximum", h);
  h = Header();
  h.mutable_k()->set_dtype(v1::FLOAT16);
  bad.emplace_back("k dtype differs from q", h);
  h = Header();
  h.mutable_v()->set_shape(1, 5);
  bad.emplace_back("v shape differs from k", h);
  h = Header();
  h.mutable_k()->set_shape(0, 2);
  h.mutable_v()->set_shape(0, 2);
  bad.emplace_back("batch differs", h);
  h = Header();
  h.mutable_q()->set_dtype(v1::DTYPE_UNSPECIFIED);
  bad.emplace_back("no dtype", h);
  h = Header();
  h.set_softmax_scale(-1.f);
  bad.emplace_back("negative softmax_scale", h);
  h = Header();
  h.mutable_q()->set_shape(1, int64_t{1} << 25);  // 2^31 elements > 2^28
  bad.emplace_back("q over --max_tensor_elements", h);
  h = Header(1, 4096, 8, 128);  // 3 x 8 MiB > max_session_bytes below
  bad.emplace_back("session over max_session_bytes", h);
  return bad;
}

TEST(SessionTableTest, ValidatesTheHeaderBeforeAllocating) {
  std::atomic<int> allocations{0};
  PinnedPoolOptions options;
  options.capacity_bytes = size_t{64} << 20;
  absl::StatusOr<std::unique_ptr<PinnedPool>> pool =
      PinnedPool::Create(options, std::make_unique<CountingAllocator>(&allocations));
  ASSERT_TRUE(pool.ok()) << pool.status();
  StreamLimits limits;
  limits.max_session_bytes = int64_t{16} << 20;
  SessionTable table(limits, Accepted(), pool->get());
  for (const auto& [why, header] : BadHeaders()) {
    const absl::Status status = table.Open(header).status();
    EXPECT_FALSE(status.ok()) << why;
    EXPECT_EQ(allocations.load(), 0) << why << ": allocated before refusing (" << status << ")";
  }
  EXPECT_EQ((*pool)->stats().allocations, 0);
  EXPECT_EQ(table.size(), 0u);
  EXPECT_EQ(table.total_bytes(), 0);
  auto good = table.Open(Header(1, 16, 4, 8));
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(allocations.load(), 1);
  EXPECT_TRUE((*good)->io()->pinned());
}

// OpenSession says what Attention says about the same header (one validation, api/validation.h).
TEST(SessionTableTest, RefusesWithTheNativeApisMessages) {
  SessionTable table(StreamLimits{}, Accepted());
  for (const auto& [why, header] : BadHeaders()) {
    if (std::string(why) == "session over max_session_bytes") continue;  // a stream-only limit
    v1::AttentionRequest request = header;
    for (v1::Tensor* t : {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
      int64_t bytes = t->dtype() == v1::FLOAT32 ? 4 : 2;
      for (int64_t d : t->shape()) bytes *= d;
      if (bytes < (int64_t{1} << 24)) t->set_data(std::string(size_t(bytes), '\0'));
    }
    const absl::Status native = ValidateAttentionRequest(request, Accepted()).status();
    const absl::Status stream = table.Open(header).status();
    ASSERT_FALSE(native.ok()) << why;
    EXPECT_EQ(stream.code(), native.code()) << why;
    EXPECT_EQ(stream.message(), native.message()) << why;
  }
}

// A session's tensors travel in Upload chunks, O in the answer or Download: a shared-memory
// reference in the header was accepted and ignored (the region never read or written).
TEST(SessionTableTest, RefusesSharedMemoryReferences) {
  SessionTable table(StreamLimits{}, Accepted());
  std::vector<std::pair<std::string, v1::AttentionRequest>> headers;
  for (const char* name : {"q", "k", "v", "out_shm", "lse_shm"}) {
    v1::AttentionRequest h = Header();
    v1::SharedMemoryRef ref;
    ref.set_region("r");
    ref.set_byte_size(64);
    const std::string n = name;
    if (n == "q") *h.mutable_q()->mutable_shm() = ref;
    if (n == "k") *h.mutable_k()->mutable_shm() = ref;
    if (n == "v") *h.mutable_v()->mutable_shm() = ref;
    if (n == "out_shm") *h.mutable_out_shm() = ref;
    if (n == "lse_shm") *h.mutable_lse_shm() = ref;
    headers.emplace_back(n, h);
  }
  for (const auto& [name, header] : headers) {
    const absl::Status status = table.Open(header).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(status.message().find("shared memory is not supported by the stream service"),
              std::string::npos)
        << name << ": " << status;
    EXPECT_EQ(status.message().rfind(name, 0), 0u) << status;
  }
  EXPECT_EQ(table.size(), 0u);
}

TEST(SessionIdTest, Is128RandomBitsInHex) {
  constexpr int kIds = 2000;
  std::set<std::string> ids;
  int ones[128] = {};
  for (int i = 0; i < kIds; ++i) {
    absl::StatusOr<std::string> id = NewSessionId();
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_EQ(id->size(), 32u) << *id;
    for (int c = 0; c < 32; ++c) {
      const char x = (*id)[size_t(c)];
      ASSERT_TRUE((x >= '0' && x <= '9') || (x >= 'a' && x <= 'f')) << *id;
      const int nibble = x <= '9' ? x - '0' : x - 'a' + 10;
      for (int b = 0; b < 4; ++b) ones[c * 4 + b] += (nibble >> b) & 1;
    }
    ids.insert(*id);
  }
  EXPECT_EQ(ids.size(), size_t(kIds));
  // Every bit varies and is set about half the time (binomial(2000, 1/2): mean 1000, sd 22); a
  // counter, a 32-bit seed spread thin or a constant half would leave bits stuck or skewed.
  for (int bit = 0; bit < 128; ++bit) {
    EXPECT_GT(ones[bit], 850) << "bit " << bit;
    EXPECT_LT(ones[bit], 1150) << "bit " << bit;
  }
  // The table hands out such ids.
  SessionTable table(StreamLimits{}, Accepted());
  auto session = table.Open(Header());
  ASSERT_TRUE(session.ok());
  EXPECT_EQ((*session)->id().size(), 32u);
}

TEST(SessionTableTest, ConcurrentOpensStayUnderTheSessionCap) {
  StreamLimits limits;
  limits.max_sessions = 3;
  SessionTable table(limits, Accepted());
  std::atomic<int> opened{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        if (table.Open(Header(1, 64, 2, 64)).ok()) opened.fetch_add(1);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(opened.load(), 3);
  EXPECT_EQ(table.size(), 3u);
}

}  // namespace
}  // namespace flashserve
