// Races of an Append, which copies its rows outside the cache's lock, with the calls that take its
// sequence meanwhile: a Release that wins answers the Append NOT_FOUND (it answered OK, with the
// lengths of a sequence that was gone), and no other sequence is handed the pages being written
// before the copy ends; a Truncate waits for the copy and then cuts it.
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kv_test_util.h"
#include "kvcache/sequence_cache.h"

namespace flashserve::kvcache {
namespace {

constexpr kernels::DType kF16 = kernels::DType::kFloat16;
// Pages of 16 rows of one head of 64 fp16: K then V, 2 KiB each.
constexpr int kPageTokens = 16;
constexpr int64_t kPageBytes = 4096;
constexpr int64_t kHalfPageBytes = 2048;

// A store that records every write (offset, bytes) and holds the first write of kHalfPageBytes or
// more (a full page of K or V: an append's, never a one-row prefix's) until the test opens it.
class RaceStore final : public KvStore {
 public:
  struct Written {
    int64_t offset = 0, bytes = 0;
  };
  std::string_view kind() const override { return "race"; }
  int64_t capacity_bytes() const override { return 4 << 20; }
  absl::Status Write(int64_t offset, const void*, int64_t bytes, BytesAt) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writes_.push_back({offset, bytes});
    }
    if (bytes >= kHalfPageBytes) gate_.Wait();
    return absl::OkStatus();
  }
  absl::Status Attend(const PagedBatch&, AttendInfo*) override { return absl::OkStatus(); }
  void WaitUntilBlocked() { gate_.WaitUntilWaiting(); }
  void Open() { gate_.Open(); }
  // The pages written by writes of `bytes` (whole-page K/V: the append; one row: the prefix).
  std::set<int64_t> PagesWrittenBy(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<int64_t> pages;
    for (const Written& w : writes_) {
      if (w.bytes == bytes) pages.insert(w.offset / kPageBytes);
    }
    return pages;
  }

 private:
  testing::Gate gate_;
  std::mutex mu_;
  std::vector<Written> writes_;  // guarded by mu_
};

class AppendRaceTest : public ::testing::Test {
 protected:
  // A sequence of one layer with `prefix` rows.
  std::string Create(int prefix) {
    CreateRequest request;
    request.shape = {1, 1, 1, 64, kF16};
    if (prefix > 0) {
      prefix_.push_back(testing::RandomRows(&rng_, prefix, 1, 64, kF16));
      const HostRows rows = testing::Rows(prefix_.back(), 1, 64, kF16);
      request.prefix.push_back({0, rows, rows});
    }
    absl::StatusOr<SequenceStatus> created = cache_->CreateSequence(request);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->id : "";
  }
  // Appends two pages of rows to `id` on a thread of its own; returns once the copy of the first
  // page is held by the store (the cache's lock is free, the sequence pinned and appending).
  std::future<absl::StatusOr<AppendResult>> HeldAppend(const std::string& id) {
    auto appended =
        std::async(std::launch::async, [this, id] { return cache_->Append(id, Big()); });
    store_.WaitUntilBlocked();
    return appended;
  }
  std::vector<LayerRows> Big() const {
    const HostRows rows = testing::Rows(big_, 1, 64, kF16);
    return {{0, rows, rows}};
  }

  std::mt19937 rng_{20261201};
  const testing::Bits big_ = testing::RandomRows(&rng_, 2 * kPageTokens, 1, 64, kF16);
  std::vector<testing::Bits> prefix_;  // the prefixes' rows, alive while the test runs
  RaceStore store_;
  std::unique_ptr<SequenceCache> cache_ = testing::SmallCache(&store_, kPageTokens);
};

// The Release lands while the Append copies; before the fix the Append answered OK, its rows in no
// sequence anyone could name. Now it answers exactly what an Append after the Release answers.
TEST_F(AppendRaceTest, AnAppendThatLosesARaceWithAReleaseAnswersNotFound) {
  const std::string a = Create(0);
  auto appended = HeldAppend(a);
  int64_t released = 0;
  const std::vector<std::string> not_found = cache_->Release({a}, &released);
  // Another sequence takes pages while the copy still writes A's: never one of them.
  const std::string b = Create(1);
  store_.Open();
  EXPECT_TRUE(not_found.empty());
  EXPECT_EQ(released, 1);
  const absl::StatusOr<AppendResult> raced = appended.get();
  ASSERT_EQ(raced.status().code(), absl::StatusCode::kNotFound)
      << "an Append whose sequence was released under it answered " << raced.status();
  EXPECT_EQ(MissingSequenceIdList(raced.status()), a);
  EXPECT_EQ(raced.status(), cache_->Append(a, Big()).status())
      << "the race's loser is not answered as an Append after the Release";
  const std::set<int64_t> copied = store_.PagesWrittenBy(kHalfPageBytes);
  const std::set<int64_t> of_b = store_.PagesWrittenBy(128);
  ASSERT_EQ(copied.size(), 2u);
  ASSERT_EQ(of_b.size(), 1u);
  EXPECT_EQ(copied.count(*of_b.begin()), 0u) << "B was given a page the copy was writing";
  // A's pages went back to the pool once the copy ended: only B's page is held.
  EXPECT_EQ(cache_->Stats().sequences, 1);
  EXPECT_EQ(cache_->Stats().used_bytes, kPageBytes);
  EXPECT_EQ(cache_->Info(b)->lengths, std::vector<int64_t>{1});
}

// A Truncate of the sequence an Append copies into waits for the copy (cutting under it would
// leave rows past the length the Append then sets), then cuts what the Append added.
TEST_F(AppendRaceTest, ATruncateWaitsForTheCopyAndThenCutsIt) {
  const std::string a = Create(1);
  auto appended = HeldAppend(a);
  auto cut = std::async(std::launch::async, [this, a] {
    return cache_->Truncate({{a, 1, {}}}, absl::Now() + absl::Seconds(30));
  });
  const bool waited = cut.wait_for(std::chrono::milliseconds(100)) == std::future_status::timeout;
  store_.Open();
  EXPECT_TRUE(waited) << "a Truncate cut while an Append copied into the sequence";
  const absl::StatusOr<AppendResult> result = appended.get();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(result->lengths, std::vector<int64_t>{1 + 2 * kPageTokens});
  const absl::StatusOr<std::vector<TruncateResult>> truncated = cut.get();
  ASSERT_TRUE(truncated.ok()) << truncated.status();
  EXPECT_EQ(truncated->front().dropped, 2 * kPageTokens);
  EXPECT_EQ(cache_->Info(a)->lengths, std::vector<int64_t>{1});
  EXPECT_EQ(cache_->Stats().used_bytes, kPageBytes) << "the pages past the cut were kept";
}

}  // namespace
}  // namespace flashserve::kvcache
