// SequenceCache::PrepareStep: find, validate, append and pin the items of one DecodeStep.
#include <algorithm>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvcache/sequence_cache_internal.h"
#include "kvcache/sequence_id.h"

namespace flashserve::kvcache {

namespace {
constexpr char kMissingIdsPayload[] = "type.flashserve.dev/missing-sequence-ids";
}  // namespace

absl::Status UnknownSequences(const std::vector<std::string_view>& ids) {
  std::vector<std::string> shown, well_formed;
  for (std::string_view id : ids) {
    shown.push_back(ShownSequenceId(id));  // a malformed id: its size only, never its bytes
    if (WellFormedSequenceId(id)) well_formed.emplace_back(id);
  }
  absl::Status status = absl::NotFoundError(absl::StrCat(
      ids.size(), " unknown or evicted sequence(s) (re-create them with their prefix): ",
      absl::StrJoin(shown, ",").substr(0, 4096)));
  if (!well_formed.empty())
    status.SetPayload(kMissingIdsPayload, absl::Cord(absl::StrJoin(well_formed, ",")));
  return status;
}

std::string MissingSequenceIdList(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kNotFound) return "";
  const auto payload = status.GetPayload(kMissingIdsPayload);
  return payload.has_value() ? std::string(*payload) : "";
}

absl::Status SequenceCache::FindAll(const std::vector<StepItem>& items,
                                    std::vector<Sequence*>* found) {
  std::vector<std::string_view> ids;
  ids.reserve(items.size());
  for (const StepItem& item : items) ids.push_back(item.id);
  return FindIds(ids, found);
}

absl::Status SequenceCache::FindIds(const std::vector<std::string_view>& ids,
                                    std::vector<Sequence*>* found) {
  std::vector<std::string_view> missing;
  std::set<std::string_view> missing_set;  // well-formed ids only: malformed ones are not compared
  for (std::string_view id : ids) {
    Sequence* seq = FindLocked(id);
    found->push_back(seq);
    if (seq == nullptr && (!WellFormedSequenceId(id) || missing_set.insert(id).second)) {
      missing.push_back(id);
    }
  }
  if (missing.empty()) return absl::OkStatus();
  if (metrics_ != nullptr) metrics_->RecordRefused("not_found");
  return UnknownSequences(missing);
}

namespace {

// Each (sequence, layer) at most once in a call: sorted, a repeat sits beside its first
// occurrence; the item named is the earliest repeat, as a scan in item order would find it.
// (A template only because SequenceCache::Sequence is private to the class.)
template <typename SequencePtr>
absl::Status CheckNoRepeats(const std::vector<StepItem>& items,
                            const std::vector<SequencePtr>& sequences) {
  std::vector<std::tuple<SequencePtr, int, size_t>> keys;
  keys.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) keys.emplace_back(sequences[i], items[i].layer, i);
  std::sort(keys.begin(), keys.end());
  size_t repeat = items.size();
  for (size_t j = 1; j < keys.size(); ++j) {
    const bool same = std::get<0>(keys[j]) == std::get<0>(keys[j - 1]) &&
                      std::get<1>(keys[j]) == std::get<1>(keys[j - 1]);
    if (same) repeat = std::min(repeat, std::get<2>(keys[j]));
  }
  if (repeat == items.size()) return absl::OkStatus();
  const StepItem& item = items[repeat];
  return absl::InvalidArgumentError(absl::StrCat("item ", repeat, ": sequence ", item.id,
                                                 " layer ", item.layer,
                                                 " appears twice in one call"));
}

}  // namespace

absl::Status SequenceCache::ValidateStep(const std::vector<StepItem>& items,
                                         const std::vector<Sequence*>& found,
                                         std::vector<int64_t>* fresh_rows) const {
  fresh_rows->assign(items.size(), 0);
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& item = items[i];
    const Sequence& seq = *found[i];
    if (absl::Status s = CheckSameShape(found[0]->shape, seq.shape); !s.ok()) return s;
    if (item.layer < 0 || item.layer >= seq.shape.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": layer ", item.layer,
                                                     " out of range (num_layers ",
                                                     seq.shape.num_layers, ")"));
    }
    if (absl::Status s = CheckQueryRows(seq.shape, item.q); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": ", s.message()));
    }
    if (absl::Status s = CheckKvRows(seq.shape, item.k, item.v); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": ", s.message()));
    }
    const int64_t length = seq.lengths[size_t(item.layer)];
    absl::StatusOr<bool> there =
        RowsAlreadyThere(item.layer, length, item.expected_length, item.k.rows);
    if (!there.ok()) {
      return absl::Status(there.status().code(),
                          absl::StrCat("item ", i, ": ", there.status().message()));
    }
    (*fresh_rows)[i] = *there ? 0 : item.k.rows;
    if (length + (*fresh_rows)[i] > seq.max_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "item ", i, ": appending ", item.k.rows, " rows would make layer ", item.layer, " ",
          length + item.k.rows, " tokens, past the sequence's limit of ", seq.max_tokens));
    }
  }
  return CheckNoRepeats(items, found);
}

PagedItem SequenceCache::ItemFor(const Sequence& seq, int layer, const HostRows& q) const {
  PagedItem item;
  item.q = q.data;
  item.q_at = q.at;
  item.rows_q = int(q.rows);
  item.length = seq.lengths[size_t(layer)];
  item.pages = seq.page_ids[size_t(layer)];
  return item;
}

// All or nothing, as Append: every item's rows are written before any length moves, so a write
// that fails half-way (a device fault) leaves every length as it was (the pages grown for the rows
// stay the sequences').
absl::Status SequenceCache::WriteStepRows(const std::vector<StepItem>& items,
                                          const std::vector<Sequence*>& found,
                                          const std::vector<bool>& there,
                                          std::vector<int64_t>* fresh) {
  for (size_t i = 0; i < items.size(); ++i) {
    if (!there[i]) GrowTable(found[i], items[i].layer, items[i].k.rows, fresh);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (there[i]) continue;
    const StepItem& item = items[i];
    const int64_t from = found[i]->lengths[size_t(item.layer)];
    if (absl::Status s = CopyRows(*found[i], item.layer, from, item.k, item.v); !s.ok()) return s;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (!there[i]) found[i]->lengths[size_t(items[i].layer)] += items[i].k.rows;
  }
  return absl::OkStatus();
}

absl::StatusOr<StepPlan> SequenceCache::PrepareStep(const std::vector<StepItem>& items,
                                                    absl::Time deadline,
                                                    const std::function<bool()>& cancelled) {
  if (items.empty()) return absl::InvalidArgumentError("a step needs at least one item");
  std::unique_lock<std::mutex> lock(mu_);
  MaybeEvictLocked();
  std::vector<Sequence*> found;
  while (true) {  // an Append copying rows into one of them goes first
    found.clear();
    if (absl::Status s = FindAll(items, &found); !s.ok()) return s;
    if (std::none_of(found.begin(), found.end(), [](const Sequence* q) { return q->appending; }))
      break;
    if (!WaitForAppendLocked(&lock, deadline, cancelled)) break;  // answered below
  }
  if (absl::Status s = CheckStillWanted(Now(), deadline, cancelled,
                                        "while it waited for another append to its sequence");
      !s.ok())
    return s;
  // Still appending: the wait gave up (a wall clock stepped back may pass the check above).
  if (std::any_of(found.begin(), found.end(), [](const Sequence* q) { return q->appending; }))
    return StillAppending();
  std::vector<int64_t> fresh_rows;
  if (absl::Status s = ValidateStep(items, found, &fresh_rows); !s.ok()) {
    if (metrics_ != nullptr && s.code() == absl::StatusCode::kAborted)
      metrics_->RecordRefused("length_mismatch");
    return s;
  }
  std::vector<PageRun> runs;
  for (size_t i = 0; i < items.size(); ++i) {
    runs.push_back(RunToGrow(*found[i], items[i].layer,
                             found[i]->lengths[size_t(items[i].layer)] + fresh_rows[i]));
  }
  std::vector<int64_t> fresh;
  // In use: not evicted to make room for this very step (pinned while it is made).
  const absl::Status taken = TakePages(found[0]->format.page_bytes, runs, found, &fresh);
  const absl::Time now = Now();
  for (Sequence* seq : found) seq->last_used = now;  // used, even by a step that found no room
  if (!taken.ok()) return taken;
  std::vector<bool> there(items.size());
  for (size_t i = 0; i < items.size(); ++i) there[i] = fresh_rows[i] < items[i].k.rows;
  if (absl::Status s = WriteStepRows(items, found, there, &fresh); !s.ok()) {
    // The items written before the failure may read a client's region: land them while the
    // call, and so its lease, lasts.
    store_->Settle().IgnoreError();  // a failure there is reported by the store itself
    PublishLocked();
    return s;
  }
  StepPlan plan;
  plan.cache_ = this;
  plan.batch.shape = found[0]->shape;
  plan.batch.format = found[0]->format;
  int64_t already = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    Sequence* seq = found[i];
    already += there[i];
    ++seq->pins;
    plan.pinned_.push_back(seq);
    plan.batch.items.push_back(ItemFor(*seq, items[i].layer, items[i].q));
    plan.already_appended.push_back(there[i]);
  }
  if (metrics_ != nullptr && already > 0) metrics_->RecordAlreadyAppended(already);
  PublishLocked();
  return plan;
}

StepPlan::StepPlan(StepPlan&& other) noexcept
    : batch(std::move(other.batch)),
      already_appended(std::move(other.already_appended)),
      cache_(std::exchange(other.cache_, nullptr)),
      pinned_(std::move(other.pinned_)) {}

StepPlan& StepPlan::operator=(StepPlan&& other) noexcept {
  if (this != &other) {
    Unpin();
    batch = std::move(other.batch);
    already_appended = std::move(other.already_appended);
    cache_ = std::exchange(other.cache_, nullptr);
    pinned_ = std::move(other.pinned_);
  }
  return *this;
}

StepPlan::~StepPlan() { Unpin(); }

void StepPlan::Unpin() {
  if (cache_ != nullptr && !pinned_.empty()) cache_->Unpin(pinned_);
  pinned_.clear();
  cache_ = nullptr;
}

}  // namespace flashserve::kvcache
