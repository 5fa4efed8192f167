// create_token: a CreateSequence retried after a lost answer finds the sequence its first try made
// (already_created) instead of making a second one that holds pages until its TTL; the token lives
// exactly as long as its sequence, never bypasses --max_sequences for a new sequence, and
// concurrent creates with one token make one sequence.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kv_test_util.h"
#include "kvcache/kv_metrics.h"
#include "kvcache/sequence_cache.h"
#include "metrics/metrics.h"
#include "runtime/cpu_kv_store.h"

namespace flashserve::kvcache {
namespace {

using kernels::DType;
using testing::Bits;
using testing::RandomRows;
using testing::Rows;

constexpr DType kDtype = DType::kFloat16;
constexpr int kHeadsQ = 4, kHeadsKv = 2, kDim = 32;
const std::string kToken = "Zq0-9_aB7cD3eF5gH1jK2m";  // 22 characters, as token_urlsafe(16)

class CreateTokenTest : public ::testing::Test {
 protected:
  void Make(int max_sequences = 64, absl::Duration ttl = absl::Seconds(300)) {
    cache_.reset();  // before the store it borrows, and the store before its pool
    store_.reset();
    pool_ = std::make_unique<kernels::cpu::ThreadPool>(2);
    store_ = *CpuKvStore::Create(4 << 20, pool_.get());
    KvCacheOptions options;
    options.capacity_bytes = 4 << 20;
    options.page_tokens = 4;
    options.ttl = ttl;
    options.max_sequences = max_sequences;
    options.max_sequence_tokens = 1000;
    options.clock = [this] { return now_; };
    cache_ = *SequenceCache::Create(options, store_.get(), &metrics_);
  }
  void SetUp() override { Make(); }

  // Two layers; `prefix_rows` rows of random K/V in layer 0 (kept alive by the fixture).
  CreateRequest Request(const std::string& token, int64_t prefix_rows = 6) {
    CreateRequest request;
    request.shape = {2, kHeadsQ, kHeadsKv, kDim, kDtype};
    request.create_token = token;
    if (prefix_rows > 0) {
      kept_.push_back(RandomRows(&rng_, prefix_rows, kHeadsKv, kDim, kDtype));
      const HostRows rows = Rows(kept_.back(), kHeadsKv, kDim, kDtype);
      request.prefix.push_back({0, rows, rows});
    }
    return request;
  }
  std::string Rendered() { return registry_.Render(); }

  std::mt19937 rng_{20261130};
  std::vector<Bits> kept_;  // the requests' rows (a vector's move keeps their buffers)
  absl::Time now_ = absl::FromUnixSeconds(1000);
  metrics::Registry registry_;
  KvCacheMetrics metrics_{&registry_};
  std::unique_ptr<kernels::cpu::ThreadPool> pool_;
  std::unique_ptr<CpuKvStore> store_;
  std::unique_ptr<SequenceCache> cache_;
};

TEST_F(CreateTokenTest, TheSameTokenAnswersTheSameSequenceAndTakesNothing) {
  absl::StatusOr<SequenceStatus> first = cache_->CreateSequence(Request(kToken));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->already_created);
  const CacheStats before = cache_->Stats();
  EXPECT_EQ(before.sequences, 1);
  EXPECT_EQ(before.pages_used, 2);  // 6 rows in pages of 4
  // The retry carries other bytes (the server compares row counts) and another label.
  CreateRequest retry = Request(kToken);
  retry.label = "another label";
  absl::StatusOr<SequenceStatus> again = cache_->CreateSequence(retry);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_created);
  EXPECT_EQ(again->id, first->id);
  EXPECT_EQ(again->lengths, first->lengths);
  EXPECT_EQ(again->max_tokens, first->max_tokens);
  const CacheStats after = cache_->Stats();
  EXPECT_EQ(after.sequences, before.sequences);
  EXPECT_EQ(after.pages_used, before.pages_used);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  const std::string text = Rendered();
  EXPECT_NE(text.find("flashserve_kv_sequences_created_total 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("flashserve_kv_sequences_already_created_total 1\n"), std::string::npos)
      << text;
  // Without a token every create is a new sequence (today's behaviour).
  EXPECT_NE(cache_->CreateSequence(Request(""))->id, cache_->CreateSequence(Request(""))->id);
}

TEST_F(CreateTokenTest, AReplayAfterAppendsAnswersTheCurrentLengths) {
  const std::string id = cache_->CreateSequence(Request(kToken))->id;
  const Bits rows = RandomRows(&rng_, 3, kHeadsKv, kDim, kDtype);
  const HostRows r = Rows(rows, kHeadsKv, kDim, kDtype);
  ASSERT_TRUE(cache_->Append(id, {{0, r, r, 6}, {1, r, r, 0}}).ok());
  absl::StatusOr<SequenceStatus> again = cache_->CreateSequence(Request(kToken));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->already_created);
  EXPECT_EQ(again->id, id);
  EXPECT_EQ(again->lengths, (std::vector<int64_t>{9, 3}));
}

TEST_F(CreateTokenTest, OtherSettingsAreAlreadyExistsNamingTheSetting) {
  ASSERT_TRUE(cache_->CreateSequence(Request(kToken)).ok());
  struct Case {
    const char* named;
    void (*change)(CreateRequest*);
  };
  const Case cases[] = {
      {"num_layers = 2, this request has 3", [](CreateRequest* r) { r->shape.num_layers = 3; }},
      {"heads_q = 4, this request has 2", [](CreateRequest* r) { r->shape.heads_q = 2; }},
      {"heads_kv = 2, this request has 1",
       [](CreateRequest* r) {
         r->shape.heads_kv = 1;
         r->prefix.clear();
       }},
      {"head_dim = 32, this request has 64",
       [](CreateRequest* r) {
         r->shape.head_dim = 64;
         r->prefix.clear();
       }},
      {"dtype = float16, this request has bfloat16",
       [](CreateRequest* r) {
         r->shape.dtype = DType::kBFloat16;
         r->prefix.clear();
       }},
      {"max_tokens = 1000, this request has 500", [](CreateRequest* r) { r->max_tokens = 500; }},
      {"prefix rows of layer 0 = 6, this request has 0",
       [](CreateRequest* r) { r->prefix.clear(); }},
      {"prefix rows of layer 1 = 0, this request has 6",
       [](CreateRequest* r) {
         r->prefix.push_back({1, r->prefix[0].k, r->prefix[0].v});
       }},
  };
  for (const Case& c : cases) {
    CreateRequest request = Request(kToken);
    c.change(&request);
    absl::StatusOr<SequenceStatus> refused = cache_->CreateSequence(request);
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << c.named;
    EXPECT_NE(refused.status().message().find(c.named), std::string::npos) << refused.status();
    EXPECT_EQ(refused.status().message().find(kToken), std::string::npos) << refused.status();
  }
  EXPECT_EQ(cache_->Stats().sequences, 1);
  // The same effective max_tokens, spelled out, is the same create.
  CreateRequest spelled = Request(kToken);
  spelled.max_tokens = 1000;
  EXPECT_TRUE(cache_->CreateSequence(spelled)->already_created);
}

TEST_F(CreateTokenTest, MalformedTokensAreInvalidArgumentAndNeverEchoed) {
  const std::string bad[] = {
      std::string(15, 'a'),       std::string(65, 'a'),
      std::string(16, 'a') + "/", "abcdefghijklmno=",
      "abcdefgh ijklmnop",        "abcdefgh.ijklmnop",
      "abcdefgh\nijklmnop",       std::string(8, 'a') + std::string("\0", 1) + std::string(8, 'a'),
      "abcdefgh\xc3\xa9ijklmnop",
  };
  for (const std::string& token : bad) {
    absl::StatusOr<SequenceStatus> r = cache_->CreateSequence(Request(token));
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << token.size();
    const std::string message(r.status().message());
    EXPECT_NE(message.find("(" + std::to_string(token.size()) + " bytes)"), std::string::npos)
        << message;
    EXPECT_EQ(message.find(token), std::string::npos) << "the token was echoed: " << message;
  }
  EXPECT_EQ(cache_->Stats().sequences, 0);
  EXPECT_EQ(cache_->Stats().pages_used, 0);
  for (size_t n : {size_t(16), size_t(64)}) {
    EXPECT_TRUE(cache_->CreateSequence(Request(std::string(n, 'x'))).ok()) << n;
  }
}

TEST_F(CreateTokenTest, AReleasedSequenceForgetsItsToken) {
  const std::string id = cache_->CreateSequence(Request(kToken))->id;
  ASSERT_TRUE(cache_->CreateSequence(Request(kToken))->already_created);
  EXPECT_TRUE(cache_->Release({id}).empty());
  absl::StatusOr<SequenceStatus> later = cache_->CreateSequence(Request(kToken));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_FALSE(later->already_created);
  EXPECT_NE(later->id, id);
  EXPECT_EQ(cache_->Stats().sequences, 1);
}

TEST_F(CreateTokenTest, AReplayIsAUseAndAnEvictedSequenceForgetsItsToken) {
  Make(64, absl::Seconds(10));
  const std::string id = cache_->CreateSequence(Request(kToken))->id;
  now_ += absl::Seconds(6);
  ASSERT_TRUE(cache_->CreateSequence(Request(kToken))->already_created);  // refreshes last-used
  now_ += absl::Seconds(6);
  EXPECT_EQ(cache_->EvictIdle(), 0) << "a replay did not count as a use";
  now_ += absl::Seconds(11);
  EXPECT_EQ(cache_->EvictIdle(), 1);
  absl::StatusOr<SequenceStatus> later = cache_->CreateSequence(Request(kToken));
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_FALSE(later->already_created);
  EXPECT_NE(later->id, id);
}

TEST_F(CreateTokenTest, ATokenDoesNotBypassMaxSequencesButAReplayNeedsNoRoom) {
  Make(/*max_sequences=*/2);
  const std::string id = cache_->CreateSequence(Request(kToken))->id;
  ASSERT_TRUE(cache_->CreateSequence(Request("")).ok());
  absl::StatusOr<SequenceStatus> new_one = cache_->CreateSequence(Request(std::string(20, 'n')));
  EXPECT_EQ(new_one.status().code(), absl::StatusCode::kResourceExhausted) << new_one.status();
  absl::StatusOr<SequenceStatus> replay = cache_->CreateSequence(Request(kToken));
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->already_created);
  EXPECT_EQ(replay->id, id);
  EXPECT_EQ(cache_->Stats().sequences, 2);
}

// A store whose writes wait at a gate while it is closed, and refuse those from `refused` (a
// device fault).
class GatedRefusingStore final : public KvStore {
 public:
  std::string_view kind() const override { return "gated-refusing"; }
  int64_t capacity_bytes() const override { return 4 << 20; }
  absl::Status Write(int64_t, const void* src, int64_t, BytesAt) override {
    if (gated) gate_.Wait();
    if (src == refused) return absl::InternalError("refused write (device fault)");
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo*) override { return absl::OkStatus(); }
  void WaitUntilBlocked() { gate_.WaitUntilWaiting(); }
  void Open() { gate_.Open(); }

  std::atomic<bool> gated{false};
  std::atomic<const void*> refused{nullptr};

 private:
  testing::Gate gate_;
};

class CreateTokenRaceTest : public ::testing::Test {
 protected:
  CreateTokenRaceTest() {
    KvCacheOptions options;
    options.capacity_bytes = 4 << 20;
    options.page_tokens = 16;
    options.clock = [this] {
      ++clock_reads_;
      return absl::FromUnixSeconds(now_s_.load());
    };
    cache_ = *SequenceCache::Create(options, &store_, nullptr);
  }

  // Starts a create with kToken while another holds it in its prefix write, and returns once the
  // new one waits for it: it has read the clock twice (once to sweep, then per slice of its wait).
  std::future<absl::StatusOr<SequenceStatus>> WaitingCreate(const Bits& rows, absl::Time deadline) {
    const int64_t before = clock_reads_;
    auto create = CreateAsync(rows, deadline);
    for (int i = 0; i < 5000 && clock_reads_ < before + 2; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_GE(clock_reads_, before + 2) << "the create did not wait";
    return create;
  }
  ~CreateTokenRaceTest() override { store_.Open(); }  // every thread ends

  CreateRequest Request(const Bits& rows) {
    CreateRequest request;
    request.shape = {1, 1, 1, 64, kDtype};
    request.create_token = kToken;
    request.prefix.push_back({0, Rows(rows, 1, 64, kDtype), Rows(rows, 1, 64, kDtype)});
    return request;
  }
  std::future<absl::StatusOr<SequenceStatus>> CreateAsync(
      const Bits& rows, absl::Time deadline = absl::InfiniteFuture()) {
    return std::async(std::launch::async, [this, &rows, deadline] {
      return cache_->CreateSequence(Request(rows), deadline);
    });
  }

  GatedRefusingStore store_;
  std::atomic<int64_t> now_s_{1000};
  std::atomic<int64_t> clock_reads_{0};
  std::unique_ptr<SequenceCache> cache_;
  std::mt19937 rng_{11};
  Bits a_ = RandomRows(&rng_, 3, 1, 64, kDtype), b_ = RandomRows(&rng_, 3, 1, 64, kDtype);
};

TEST_F(CreateTokenRaceTest, AFailedPrefixWriteLeavesNoToken) {
  store_.refused = a_.data();
  absl::StatusOr<SequenceStatus> failed = cache_->CreateSequence(Request(a_));
  ASSERT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_EQ(cache_->Stats().sequences, 0);
  EXPECT_EQ(cache_->Stats().pages_used, 0);
  absl::StatusOr<SequenceStatus> retried = cache_->CreateSequence(Request(b_));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_FALSE(retried->already_created) << "a failed create left its token behind";
  EXPECT_TRUE(cache_->CreateSequence(Request(b_))->already_created);
}

TEST_F(CreateTokenRaceTest, APrefixThatOutlivedItsDeadlineLeavesNoToken) {
  store_.gated = true;
  auto first = CreateAsync(a_, absl::FromUnixSeconds(1005));
  store_.WaitUntilBlocked();
  now_s_ = 1006;
  store_.Open();
  EXPECT_EQ(first.get().status().code(), absl::StatusCode::kDeadlineExceeded);
  absl::StatusOr<SequenceStatus> retried = cache_->CreateSequence(Request(a_));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_FALSE(retried->already_created) << "a create that was not kept left its token behind";
  EXPECT_TRUE(cache_->CreateSequence(Request(a_))->already_created);
  EXPECT_EQ(cache_->Stats().sequences, 1);
}

// A create whose deadline passed while its prefix was written is kept when a retry with its token
// waits for it: the retry answers it instead of writing the prefix again.
TEST_F(CreateTokenRaceTest, ACreatePastItsDeadlineIsKeptForTheRetryWaitingForIt) {
  store_.gated = true;
  auto first = CreateAsync(a_, absl::FromUnixSeconds(1005));
  store_.WaitUntilBlocked();
  auto retry = WaitingCreate(a_, absl::FromUnixSeconds(1100));
  now_s_ = 1006;  // the first try's client has given up
  store_.Open();
  absl::StatusOr<SequenceStatus> kept = first.get();
  ASSERT_TRUE(kept.ok()) << kept.status();
  absl::StatusOr<SequenceStatus> answered = retry.get();
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_TRUE(answered->already_created);
  EXPECT_EQ(answered->id, kept->id);
  EXPECT_EQ(cache_->Stats().sequences, 1);
}

// Creates with one token from several threads, the first held in its prefix write: the others
// wait for it and answer its sequence.
TEST_F(CreateTokenRaceTest, ConcurrentCreatesWithOneTokenMakeOneSequence) {
  store_.gated = true;
  std::vector<std::future<absl::StatusOr<SequenceStatus>>> creates;
  creates.push_back(CreateAsync(a_));
  store_.WaitUntilBlocked();
  for (int i = 0; i < 6; ++i) creates.push_back(CreateAsync(a_));
  EXPECT_EQ(creates.back().wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "a create did not wait for the one holding its token";
  store_.Open();
  int made = 0;
  std::string id;
  for (auto& create : creates) {
    absl::StatusOr<SequenceStatus> r = create.get();
    ASSERT_TRUE(r.ok()) << r.status();
    made += r->already_created ? 0 : 1;
    if (id.empty()) id = r->id;
    EXPECT_EQ(r->id, id);
    EXPECT_EQ(r->lengths, std::vector<int64_t>{3});
  }
  EXPECT_EQ(made, 1);
  EXPECT_EQ(cache_->Stats().sequences, 1);
  EXPECT_EQ(cache_->Stats().pages_used, 1);
}

// Unsynchronized: threads released together, none held; still one sequence.
TEST_F(CreateTokenRaceTest, ConcurrentCreatesWithOneTokenUnheldMakeOneSequence) {
  for (int round = 0; round < 20; ++round) {
    std::atomic<bool> go{false};
    std::vector<std::future<absl::StatusOr<SequenceStatus>>> creates;
    for (int i = 0; i < 4; ++i) {
      creates.push_back(std::async(std::launch::async, [this, &go] {
        while (!go) std::this_thread::yield();
        return cache_->CreateSequence(Request(a_));
      }));
    }
    go = true;
    std::vector<std::string> ids;
    for (auto& create : creates) ids.push_back(create.get()->id);
    for (const std::string& id : ids) EXPECT_EQ(id, ids[0]) << "round " << round;
    EXPECT_EQ(cache_->Stats().sequences, 1) << "round " << round;
    EXPECT_TRUE(cache_->Release({ids[0]}).empty());
  }
}

// A create waiting for the one holding its token gives up at its deadline (retryable, nothing
// made); the first goes on and a later retry answers it.
TEST_F(CreateTokenRaceTest, AWaitingCreateGivesUpAtItsDeadline) {
  store_.gated = true;
  auto first = CreateAsync(a_);
  store_.WaitUntilBlocked();
  auto second = WaitingCreate(a_, absl::FromUnixSeconds(1005));
  now_s_ = 1006;
  const bool gave_up = second.wait_for(std::chrono::seconds(5)) == std::future_status::ready;
  store_.Open();
  ASSERT_TRUE(gave_up) << "a waiting create outlived its deadline";
  absl::StatusOr<SequenceStatus> late = second.get();
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
  EXPECT_NE(late.status().message().find("same create_token"), std::string::npos);
  const std::string id = first.get()->id;
  absl::StatusOr<SequenceStatus> retried = cache_->CreateSequence(Request(a_));
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->id, id);
  EXPECT_TRUE(retried->already_created);
}

// A create waiting for one that then fails (its prefix refused) creates the sequence itself.
TEST_F(CreateTokenRaceTest, ACreateWaitingForOneThatFailsCreatesItself) {
  store_.gated = true;
  store_.refused = a_.data();
  auto first = CreateAsync(a_);
  store_.WaitUntilBlocked();
  auto second = WaitingCreate(b_, absl::InfiniteFuture());  // the same row counts, other bytes
  store_.Open();
  EXPECT_EQ(first.get().status().code(), absl::StatusCode::kInternal);
  absl::StatusOr<SequenceStatus> made = second.get();
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_FALSE(made->already_created);
  EXPECT_EQ(cache_->Stats().sequences, 1);
  absl::StatusOr<SequenceStatus> replay = cache_->CreateSequence(Request(a_));  // the token is its
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_EQ(replay->id, made->id);
  EXPECT_TRUE(replay->already_created);
}

}  // namespace
}  // namespace flashserve::kvcache
