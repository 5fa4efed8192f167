// SequenceCache: append, release, info, eviction and the published statistics.
#include <algorithm>
#include <set>
#include <string_view>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "kvcache/sequence_cache_internal.h"
#include "kvcache/sequence_id.h"

namespace flashserve::kvcache {
namespace {
// How long a call waiting for another append (or create) sleeps before it looks at the clock
// again.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(20);
}  // namespace

bool SequenceCache::WaitForAppendLocked(std::unique_lock<std::mutex>* lock, absl::Time deadline,
                                        const std::function<bool()>& cancelled) {
  return WaitLocked(&appended_, lock, deadline, cancelled);
}

namespace {
struct NoWait {
  bool active = false;
  bool waited = false;
};
thread_local NoWait no_wait;
}  // namespace

NoWaitScope::NoWaitScope() { no_wait = NoWait{true, false}; }
NoWaitScope::~NoWaitScope() { no_wait = NoWait{}; }
bool NoWaitScope::would_have_waited() const { return no_wait.waited; }

bool SequenceCache::WaitLocked(std::condition_variable* cv, std::unique_lock<std::mutex>* lock,
                               absl::Time deadline, const std::function<bool()>& cancelled) {
  if (no_wait.active) {
    no_wait.waited = true;
    return false;
  }
  const absl::Duration left = deadline - Now();
  if (left <= absl::ZeroDuration() || (cancelled && cancelled())) return false;
  cv->wait_for(*lock, absl::ToChronoNanoseconds(std::min(left, kWaitSlice)));
  return true;
}

bool SequenceCache::AnyAppending(const std::vector<StepItem>& items) {
  if (appends_running_.load() == 0) return false;  // the common case: no lock, no lookups
  std::lock_guard<std::mutex> lock(mu_);
  return AnyAppendingLocked(items);
}

bool SequenceCache::AnyAppendingLocked(const std::vector<StepItem>& items) {
  return std::any_of(items.begin(), items.end(), [this](const StepItem& item) {
    const Sequence* seq = FindLocked(item.id);
    return seq != nullptr && seq->appending;
  });
}

void SequenceCache::AwaitAppends(const std::vector<StepItem>& items, absl::Time deadline,
                                 const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  while (AnyAppendingLocked(items) && WaitForAppendLocked(&lock, deadline, cancelled)) {
  }
}

SequenceCache::Sequence* SequenceCache::FindIdleLocked(std::string_view id,
                                                       std::unique_lock<std::mutex>* lock,
                                                       absl::Time deadline,
                                                       const std::function<bool()>& cancelled) {
  Sequence* seq = FindLocked(id);
  // Past the deadline the caller answers DEADLINE_EXCEEDED (a large append may copy for seconds).
  while (seq != nullptr && seq->appending && WaitForAppendLocked(lock, deadline, cancelled)) {
    seq = FindLocked(id);  // it may have been released meanwhile
  }
  return seq;
}

absl::Status SequenceCache::ValidateAppend(const Sequence& seq, const std::vector<LayerRows>& rows,
                                           std::vector<PageRun>* runs,
                                           std::vector<int>* already) const {
  std::vector<bool> seen(size_t(seq.shape.num_layers), false);
  for (const LayerRows& r : rows) {
    if (r.layer < 0 || r.layer >= seq.shape.num_layers || seen[size_t(r.layer)]) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", r.layer,
                                                     " is out of range or given twice (num_layers ",
                                                     seq.shape.num_layers, ")"));
    }
    seen[size_t(r.layer)] = true;
    if (absl::Status s = CheckKvRows(seq.shape, r.k, r.v); !s.ok()) return s;
    const int64_t length = seq.lengths[size_t(r.layer)];
    absl::StatusOr<bool> there = RowsAlreadyThere(r.layer, length, r.expected_length, r.k.rows);
    if (!there.ok()) return there.status();
    if (*there) {
      already->push_back(r.layer);
      continue;
    }
    const int64_t after = length + r.k.rows;
    if (after > seq.max_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("appending ", r.k.rows, " rows to layer ", r.layer, " would make it ", after,
                       " tokens, past the sequence's limit of ", seq.max_tokens));
    }
    runs->push_back(RunToGrow(seq, r.layer, after));
  }
  return absl::OkStatus();
}

// Pages are taken and the tables grown under the lock; the rows are copied outside it (a large
// append would otherwise stall every other sequence's steps), with the sequence pinned and marked
// appending; the lengths move under the lock once every row is in place.
absl::StatusOr<AppendResult> SequenceCache::Append(std::string_view id,
                                                   const std::vector<LayerRows>& given,
                                                   absl::Time deadline,
                                                   const std::function<bool()>& cancelled) {
  std::unique_lock<std::mutex> lock(mu_);
  MaybeEvictLocked();
  Sequence* seq = FindIdleLocked(id, &lock, deadline, cancelled);
  if (seq == nullptr) {
    if (metrics_ != nullptr) metrics_->RecordRefused("not_found");
    return UnknownSequences({id});
  }
  if (absl::Status s = CheckStillWanted(Now(), deadline, cancelled,
                                        "while it waited for another append to its sequence");
      !s.ok())
    return s;
  // Still appending: the wait gave up (a wall clock stepped back may pass the check above).
  if (seq->appending) return StillAppending();
  std::vector<PageRun> runs;
  AppendResult result;
  if (absl::Status s = ValidateAppend(*seq, given, &runs, &result.already_appended); !s.ok()) {
    if (metrics_ != nullptr && s.code() == absl::StatusCode::kAborted)
      metrics_->RecordRefused("length_mismatch");
    return s;
  }
  std::vector<LayerRows> rows;  // the layers that take their rows
  for (const LayerRows& r : given) {
    if (!absl::c_linear_search(result.already_appended, r.layer)) rows.push_back(r);
  }
  std::vector<int64_t> fresh;
  // `seq` is not evicted by TakePages making room (it was found; the sweep that would have
  // evicted it may not have run yet, or the clock jumped), which would free it under this call.
  const absl::Status taken = TakePages(seq->format.page_bytes, runs, {seq}, &fresh);
  seq->last_used = Now();  // used, even by an append that found no room
  if (!taken.ok()) return taken;
  for (const LayerRows& r : rows) GrowTable(seq, r.layer, r.k.rows, &fresh);
  seq->appending = true;
  appends_running_.fetch_add(1);
  ++seq->pins;  // not evicted, and a Release meanwhile frees it only at EndAppendLocked
  lock.unlock();
  absl::Status written = absl::OkStatus();
  for (const LayerRows& r : rows) {
    if (written.ok()) written = CopyRows(*seq, r.layer, seq->lengths[size_t(r.layer)], r.k, r.v);
  }
  lock.lock();
  written = EndAppendLocked(seq, id, rows, std::move(written), &result.lengths);
  lock.unlock();
  appended_.notify_all();
  unpinned_.notify_all();
  if (!written.ok()) return written;
  if (metrics_ != nullptr && !result.already_appended.empty())
    metrics_->RecordAlreadyAppended(int64_t(result.already_appended.size()));
  return result;
}

absl::Status SequenceCache::EndAppendLocked(Sequence* seq, std::string_view id,
                                            const std::vector<LayerRows>& rows,
                                            absl::Status written, std::vector<int64_t>* lengths) {
  // Released while the rows were copied: the pin kept its pages out of the pool (no row landed on
  // another sequence's), but no sequence holds the rows now. The call lost the race to the
  // Release, and answers as an Append that came after it: NOT_FOUND, never OK.
  if (seq->released) {
    if (metrics_ != nullptr) metrics_->RecordRefused("not_found");
    written = UnknownSequences({id});
  }
  if (written.ok()) {  // a device fault leaves the lengths (the grown pages stay the sequence's)
    for (const LayerRows& r : rows) seq->lengths[size_t(r.layer)] += r.k.rows;
  }
  *lengths = seq->lengths;
  seq->appending = false;
  appends_running_.fetch_sub(1);
  seq->last_used = Now();
  UnpinLocked(seq);  // may free it: not used after this
  PublishLocked();
  return written;
}

std::vector<std::string> SequenceCache::Release(const std::vector<std::string>& ids,
                                                int64_t* released) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> not_found;
  std::set<std::string_view> released_now;
  for (const std::string& id : ids) {
    // Malformed ids (never issued) are not copied, hashed or compared under the lock: 1,000 ids
    // of 1 MiB held every other client's call for seconds (audit).
    if (!WellFormedSequenceId(id) || released_now.count(id) > 0) continue;
    Sequence* seq = FindLocked(id);
    if (seq == nullptr) {
      not_found.push_back(id);
      continue;
    }
    Remove(seq);
    released_now.insert(id);
  }
  if (metrics_ != nullptr) metrics_->RecordReleased(int64_t(released_now.size()));
  PublishLocked();
  if (released != nullptr) *released = int64_t(released_now.size());
  return not_found;
}

absl::StatusOr<SequenceStatus> SequenceCache::Info(std::string_view id) {
  std::lock_guard<std::mutex> lock(mu_);
  MaybeEvictLocked();
  Sequence* seq = FindLocked(id);
  if (seq == nullptr) return UnknownSequences({id});
  SequenceStatus status = StatusOf(*seq);
  seq->last_used = Now();
  return status;
}

CacheStats SequenceCache::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats stats;
  stats.sequences = int64_t(table_.size());
  stats.used_bytes = pages_.used_bytes();
  stats.capacity_bytes = pages_.capacity_bytes();
  stats.pages_used = pages_.pages_used();
  stats.evictions = evictions_;
  return stats;
}

int64_t SequenceCache::EvictIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  return EvictIdleLocked();
}

absl::Time SequenceCache::CallWaiting() {
  std::lock_guard<std::mutex> lock(mu_);
  const absl::Time now = Now();
  waiting_since_.insert(now);
  return now;
}

void SequenceCache::CallLeft(absl::Time waiting_since) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = waiting_since_.find(waiting_since);
  if (it != waiting_since_.end()) waiting_since_.erase(it);
}

absl::Time SequenceCache::OldestWaitingLocked() const {
  const absl::Time now = Now();
  return waiting_since_.empty() ? now : std::min(now, *waiting_since_.begin());
}

void SequenceCache::MaybeEvictLocked() {
  if (options_.ttl == absl::ZeroDuration()) return;
  if (Now() - last_sweep_ >= std::max(options_.ttl / 8, absl::Milliseconds(10))) EvictIdleLocked();
}

int64_t SequenceCache::EvictIdleLocked() {
  last_sweep_ = Now();
  if (options_.ttl == absl::ZeroDuration()) return 0;
  // Idle as of the oldest waiting call's arrival: a queued call may name any sequence alive then.
  const absl::Time idle_at = OldestWaitingLocked();
  std::vector<Sequence*> idle;
  for (auto& [id, seq] : table_) {
    if (seq->ready && seq->pins == 0 && idle_at - seq->last_used >= options_.ttl)
      idle.push_back(seq.get());
  }
  for (Sequence* seq : idle) Remove(seq);
  evictions_ += int64_t(idle.size());
  if (metrics_ != nullptr && !idle.empty()) metrics_->RecordEvicted(int64_t(idle.size()));
  PublishLocked();
  return int64_t(idle.size());
}

void SequenceCache::PublishLocked() {
  if (metrics_ == nullptr) return;
  metrics_->SetPool(int64_t(table_.size()), pages_.used_bytes(), pages_.capacity_bytes(),
                    pages_.pages_used());
}

SequenceStatus SequenceCache::StatusOf(const Sequence& seq) const {
  SequenceStatus status;
  status.id = seq.id;
  status.label = seq.label;
  status.shape = seq.shape;
  status.lengths = seq.lengths;
  status.max_tokens = seq.max_tokens;
  status.idle = Now() - seq.last_used;
  status.bytes = seq.page_count() * seq.format.page_bytes;
  return status;
}

}  // namespace flashserve::kvcache
